#!/usr/bin/env bash
# Device-free check (ctest cuda_bench.PerfTableFromLogs): `perf.sh --table` rebuilds, from the
# logs GPU run 4 left (testdata/perf-run4: 2026-11-27, H100, as perf.sh wrote them), the table
# and targets docs/benchmarks.md §7.4 quotes, and formats the blocks later runs add — the
# memory-bound kernels alone, vocabpipe's attention beside PyTorch's SDPA backends, and where
# PyTorch's step goes — from lines in the formats cuda_bench and torch_baseline.py print,
# appended here to a copy of the logs.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$here"/testdata/perf-run4/*.log "$work"/
cat >> "$work/cuda_bench-gpt2-50k.log" << 'LINES'
PERF section=attention kernels=flash fwd_ms=0.747 bwd_ms=1.373 fwd_tflops=46.0 bwd_tflops=62.6
PERF section=memory kernel=copy set=- us=30.1 tbps=4.46 of_copy=1.00
PERF section=memory kernel=norm.bwd_input set=element us=415.0 tbps=0.16 of_copy=0.04
PERF section=memory kernel=norm.bwd_input set=vector us=20.0 tbps=3.36 of_copy=0.75
LINES
cat >> "$work/torch.log" << 'LINES'
TORCH_BREAKDOWN model=gpt2-50k 70.12 ms: gemm 55.0% attention 12.0% (kernels 93.6% of the wall time)
TORCH_KERNELS model=gpt2-50k: 3.10 ms nvjet_a; 2.00 ms flash_bwd
TORCH_ATTENTION model=gpt2-50k backend=default fwd_ms=0.200 bwd_ms=0.600 fwd_tflops=171.9 bwd_tflops=143.2 kernel=flash_fwd_kernel
TORCH_ATTENTION backend=cudnn model=gpt2-50k FAIL RuntimeError: No available kernel.
LINES
out=$(CUDA_BENCH=/nonexistent bash "$here/perf.sh" --table "$work" 2>&1)
rc=$?
bad=0
((rc == 0)) || {
  echo "perf.sh --table exited $rc"
  bad=1
}
expect() {
  grep -qF -- "$1" <<< "$out" || {
    echo "missing: $1"
    bad=1
  }
}
# Run 4's rows (docs/benchmarks.md §7.4) and its tensor-core variant row.
expect "gpt2-50k          33.7%   32.3%   60.0% |     73987  31.8% 13.56/15.38 |    109317  47.0% 14.36/15.02 |    0.68x"
expect "gpt2-256k         33.8%   32.4%   60.8% |     49379  36.9% 30.03/31.85 |     57798  43.1% 35.55/40.81 |    0.85x"
expect "llama             58.0%   43.5%   72.0% |     23832  43.0% 52.29/54.48 |     23716  42.8% 51.54/55.67 |    1.00x"
expect "gpt2-50k+tc       26.9%   20.6%       - |     53882  23.2%"
expect "llama           layerF 58.0%+  outS+T 72.0%+  step 43.0%-  vp/torch 1.00x-  res/use 1.04+"
expect "MFU against the measured bf16 GEMM peak 799.2 TFLOP/s"
expect "gpt2-50k        layer.B     24.14 ms: attention 45.6% norm 27.5%"
# The blocks later runs add.
expect "torch BREAKDOWN model=gpt2-50k 70.12 ms: gemm 55.0% attention 12.0%"
expect "gpt2-50k        copy                 30.1 us  4.46 TB/s  100%"
expect "gpt2-50k        norm.bwd_input   element    415.0 us  0.16 TB/s    4% | vector     20.0 us  3.36 TB/s   75%"
expect "gpt2-50k        vocabpipe flash             fwd   46.0  bwd   62.6 TFLOP/s (0.747 / 1.373 ms)"
expect "gpt2-50k        torch sdpa-default          fwd  171.9  bwd  143.2 TFLOP/s (0.200 / 0.600 ms) flash_fwd_kernel"
expect "backend=cudnn model=gpt2-50k FAIL RuntimeError: No available kernel."
# A PERF_VARIANTS entry that names no kernel switch (misspelt) or is no NAME:VAR=VALUE fails the
# dry run before anything else, naming the entry; well-formed ones pass that check.
dry=$(PERF_VARIANTS='ok:VOCABPIPE_ATTENTION=cudnn typo:VOCABPIPE_ATENTION=cudnn bare' \
  CUDA_BENCH=/nonexistent bash "$here/perf.sh" --dry-run "$work/dry" 2>&1)
rc=$?
((rc == 1)) || {
  echo "perf.sh --dry-run with bad variants exited $rc"
  bad=1
}
for line in "FAIL: PERF_VARIANTS entry 'typo:VOCABPIPE_ATENTION=cudnn' sets VOCABPIPE_ATENTION" \
  "FAIL: PERF_VARIANTS entry 'bare' is not NAME:VAR=VALUE"; do
  grep -qF -- "$line" <<< "$dry" || {
    echo "missing: $line"
    bad=1
  }
done
! grep -q "entry 'ok:" <<< "$dry" || {
  echo "a well-formed variant was refused"
  bad=1
}
[[ -s "$work/perf.txt" ]] || {
  echo "perf.txt not written"
  bad=1
}
if ((bad)); then
  echo "--- perf.sh --table printed:"
  echo "$out"
  exit 1
fi
echo "perf.sh --table: run 4's table and the added blocks as expected"
