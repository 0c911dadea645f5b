#!/usr/bin/env python3
"""vocabpipe's cuDNN attention graphs against the ones cuDNN's own frontend builds.

Usage: compare_cudnn_graphs.py CUDA_KERNELS_TEST GOLDEN.jsonl

Runs CUDA_KERNELS_TEST's CudnnAttentionGraphs case (no GPU needed: it builds and finalizes both
graphs of attention_cudnn.cc at a GPT-2-like and a Llama-like grouped whole-sequence shape and at
a grouped Seq1F1B chunk, whose causal diagonal is aligned bottom-right; and, built as for cuDNN
up to 9.15, a 200-row sequence and a grouped chunk of 100 queries on 170 keys, whose backward then
carries the frontend's padding workaround, and the 200 rows as for 9.9, where the frontend applies
that padding mask a second time) with cuDNN's API log on, takes the twelve operation
graphs cuDNN prints as JSON (forward and backward, per shape), and
compares each with the graph NVIDIA's cudnn-frontend lowers its SDPA node to at the same shape
and layout (GOLDEN.jsonl, made by testdata/cudnn_frontend_sdpa_graphs.cc).

Two graphs are the same when every output tensor (O and the statistics; dQ, dK, dV) has the
same signature: its data type, dims and strides, and recursively the operation that writes it
(kind, mode, compute type, axis, reduction, determinism, alphas) with the signatures of that
operation's inputs by port. The graph's own inputs are named by role (Q, K, V, O, dO, Stats, by
uid) and by-value scalars by type and shape; intermediates carry no name, so the numbering of
virtual tensors does not matter, only what computes what. Exit 0 when all twelve match, 1 with the
first difference, 77 (ctest: skipped) when this build or machine has no cuDNN.
"""
import json
import os
import subprocess
import sys
import tempfile

# The uids both sides give the graphs' real inputs and outputs (attention_cudnn.cc's Uid enum,
# the generator's set_uid calls).
ROLES = {'1': 'Q', '2': 'K', '3': 'V', '4': 'O', '5': 'Stats', '9': 'dO',
         '10': 'dQ', '11': 'dK', '12': 'dV'}
CASES = ['GPT-2-like forward', 'GPT-2-like backward', 'grouped forward', 'grouped backward',
         'grouped chunk forward', 'grouped chunk backward',
         '200 rows forward', '200 rows backward as for cuDNN <= 9.15',
         'grouped chunk of 100 on 170 forward', 'its backward as for cuDNN <= 9.15',
         '200 rows forward as for cuDNN 9.9', 'its backward (padding mask twice)']
OP_KEYS = ['operation', 'pointwiseMode', 'mathPrec', 'axis', 'reductionOp', 'isDeterministic',
           'alpha1', 'alpha2']
INPUT_PORTS = ['X', 'B', 'T', 'matA', 'matB', 'mOverride', 'nOverride', 'kOverride']
OUTPUT_PORTS = ['Y', 'matC']


def graphs_in_log(path):
    """The operationGraph objects of every apiLog line cuDNN wrote, in order."""
    found = []
    with open(path, encoding='utf-8', errors='replace') as log:
        for line in log:
            if '"operationGraph"' not in line or 'val=' not in line:
                continue
            text = line.split('val=', 1)[1].rstrip().rstrip(';')
            found.append(json.loads(text)['operationGraph'])
    return found


def signatures(graph):
    """(output role -> signature, number of operations) of one operation graph."""
    tensors = {t['name']: t for t in graph['tensors']}
    writer = {}
    for node in graph['nodes']:
        for port in OUTPUT_PORTS:
            if port in node:
                writer[node[port]] = node
    memo = {}

    def operation(node):
        head = ','.join(f'{k}={node[k]}' for k in OP_KEYS if k in node)
        inputs = ';'.join(f'{p}:{tensor(node[p])}' for p in INPUT_PORTS if p in node)
        return f'{head}[{inputs}]'

    def tensor(name):
        if name not in memo:
            t = tensors[name]
            shape = f"{t['dataType'].replace('CUDNN_DATA_', '')}{t['dim']}{t['stride']}"
            if t.get('isByValue'):
                memo[name] = 'scalar:' + shape
            elif not t['isVirtual'] and name in ROLES and name not in writer:
                memo[name] = ROLES[name] + ':' + shape  # a graph input
            else:
                kind = 'virtual' if t['isVirtual'] else ROLES.get(name, 'memory')
                node = writer.get(name)
                memo[name] = f"{kind}:{shape}<{operation(node) if node else 'unwritten'}>"
        return memo[name]

    outputs = {ROLES[n]: tensor(n) for n, t in tensors.items()
               if n in ROLES and not t['isVirtual'] and n in writer}
    # Every operation's own signature too, so that nothing off the outputs' paths can differ.
    every = sorted(operation(node) for node in graph['nodes'])
    return outputs, every


def first_difference(a, b):
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def compare(golden, ours):
    """'' when the two graphs compute the same, else what differs first."""
    golden_out, golden_ops = signatures(golden)
    our_out, our_ops = signatures(ours)
    if len(golden_ops) != len(our_ops):
        return f'{len(our_ops)} operations, the frontend {len(golden_ops)}'
    pairs = [(role, golden_out.get(role, ''), our_out.get(role, ''))
             for role in sorted(set(golden_out) | set(our_out))]
    pairs += [(f'operation {i}', a, b) for i, (a, b) in enumerate(zip(golden_ops, our_ops))]
    for what, a, b in pairs:
        if a != b:
            i = first_difference(a, b)
            return (f'{what} differs at character {i}:\n  frontend: ...{a[max(0, i - 200):i + 200]}'
                    f'\n  ours:     ...{b[max(0, i - 200):i + 200]}')
    return ''


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    test_binary, golden_path = sys.argv[1], sys.argv[2]
    with open(golden_path, encoding='utf-8') as f:
        golden = [json.loads(line)['operationGraph'] for line in f if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, 'cudnn.log')
        env = dict(os.environ, CUDNN_LOGLEVEL_DBG='3', CUDNN_LOGDEST_DBG=log)
        run = subprocess.run([test_binary, '--gtest_filter=CudnnAttentionGraphs.*'], env=env,
                             capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            print(run.stdout[-3000:], run.stderr[-3000:])
            print('FAIL: the descriptor test itself failed')
            return 1
        if 'no cuDNN' in run.stdout or not os.path.exists(log):
            print('SKIP: no cuDNN in this build or on this machine')
            return 77
        ours = graphs_in_log(log)
    if len(ours) != len(golden):
        print(f'FAIL: {len(ours)} operation graphs logged, expected {len(golden)}')
        return 1
    failed = False
    for case, g, o in zip(CASES, golden, ours):
        difference = compare(g, o)
        print(f"{case}: {len(o['nodes'])} operations, "
              f"{'the same as' if not difference else 'NOT the same as'} the frontend's")
        if difference:
            print('  ' + difference)
            failed = True
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
