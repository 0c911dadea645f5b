#!/usr/bin/python3
"""vocabpipe against PyTorch (CPU) on the same GPT-2 training step, paired and alternating.

For each vocabulary size, `--pairs` times in turn: PyTorch trains the model `--steps` steps
(float32, AdamW, the same thread count), then `vocabpipe run --direct` trains the same model
the same number of steps (p = 1). Each side's figure is its median step time over the steps
after the first two (warm-up); each pair gives the ratio PyTorch / vocabpipe, and the median
ratio over the pairs is reported (alternating pairs: load from other jobs on the machine falls
on both sides alike). Debian's python3-torch (/usr/bin/python3) and the build's vocabpipe.

  /usr/bin/python3 bench/peer/peer_bench.py --vocabpipe build/client/vocabpipe \
      --vocab 8192 32768 --pairs 3 --steps 8 --threads 2
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import tempfile
import time

import torch


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


class Gpt2(torch.nn.Module):
    """GPT-2 (pre-LayerNorm, tied embeddings as in vocabpipe's default, GELU-tanh)."""

    def __init__(self, L, h, heads, V, s):
        super().__init__()
        self.heads = heads
        self.wte = torch.nn.Embedding(V, h)
        self.wpe = torch.nn.Embedding(s, h)
        self.blocks = torch.nn.ModuleList()
        for _ in range(L):
            self.blocks.append(torch.nn.ModuleDict({
                "ln1": torch.nn.LayerNorm(h), "qkv": torch.nn.Linear(h, 3 * h),
                "proj": torch.nn.Linear(h, h), "ln2": torch.nn.LayerNorm(h),
                "fc": torch.nn.Linear(h, 4 * h), "out": torch.nn.Linear(4 * h, h)}))
        self.lnf = torch.nn.LayerNorm(h)
        self.register_buffer("mask", torch.tril(torch.ones(s, s, dtype=torch.bool)))

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe.weight[:T]
        C, nh = x.shape[-1], self.heads
        for b in self.blocks:
            q, k, v = b["qkv"](b["ln1"](x)).split(C, dim=2)
            q = q.view(B, T, nh, C // nh).transpose(1, 2)
            k = k.view(B, T, nh, C // nh).transpose(1, 2)
            v = v.view(B, T, nh, C // nh).transpose(1, 2)
            att = (q @ k.transpose(-2, -1)) / math.sqrt(C // nh)
            att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(dim=-1)
            x = x + b["proj"]((att @ v).transpose(1, 2).reshape(B, T, C))
            x = x + b["out"](gelu_tanh(b["fc"](b["ln2"](x))))
        logits = self.lnf(x) @ self.wte.weight.T
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 targets.reshape(-1))


def torch_step_times(a, V):
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    model = Gpt2(a.layers, a.hidden, a.heads, V, a.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        for _ in range(a.microbatches):
            idx = torch.randint(0, V, (a.batch, a.seq + 1))
            loss = model(idx[:, :-1], idx[:, 1:]) / a.microbatches
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def vocabpipe_step_times(a, V, work):
    data = os.path.join(work, f"data_{V}.bin")
    if not os.path.exists(data):
        subprocess.run([a.vocabpipe, "data", "synth", "--vocab", str(V), "--tokens", "400000",
                        "--out", data], check=True, stdout=subprocess.DEVNULL)
    run = os.path.join(work, f"run_{V}")
    spec = os.path.join(work, f"job_{V}.yaml")
    with open(spec, "w") as f:
        f.write(f"model: {{layers: {a.layers}, hidden: {a.hidden}, heads: {a.heads}, "
                f"vocab_size: {V}, seq_len: {a.seq}}}\n"
                f"parallel: {{pipeline: 1, microbatch_size: {a.batch}, "
                f"microbatches: {a.microbatches}}}\n"
                f"train: {{steps: {a.steps}, lr: 0.0003, threads: {a.threads}}}\n"
                f"data: {{path: {data}}}\ncheckpoint: {{dir: {run}, every: 0}}\n")
    subprocess.run(["rm", "-rf", run], check=True)
    subprocess.run([a.vocabpipe, "run", "--direct", spec], check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line)["step_seconds"] for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocabpipe", required=True)
    ap.add_argument("--vocab", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=1)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="vp_peer_") as work:
        for V in a.vocab:
            ratios, tt, vt = [], [], []
            for _ in range(a.pairs):
                t = statistics.median(torch_step_times(a, V)[2:])
                v = statistics.median(vocabpipe_step_times(a, V, work)[2:])
                tt.append(t)
                vt.append(v)
                ratios.append(t / v)
                print(f"V={V}: pytorch {t * 1e3:.0f} ms/step, vocabpipe {v * 1e3:.0f} ms/step, "
                      f"ratio {t / v:.2f}", flush=True)
            print(f"V={V}: median over {a.pairs} pairs: pytorch {statistics.median(tt) * 1e3:.0f} "
                  f"ms, vocabpipe {statistics.median(vt) * 1e3:.0f} ms, pytorch/vocabpipe "
                  f"{statistics.median(ratios):.2f}x (L={a.layers} h={a.hidden} s={a.seq} "
                  f"b={a.batch} threads={a.threads}, torch {torch.__version__})", flush=True)


if __name__ == "__main__":
    main()
