#!/usr/bin/env python3
"""Pipeline runtime benchmark: real `vocabpipe run --direct` launches (p worker processes over
Gloo on loopback, no control plane) for each vocabulary method, measured tokens/s and per-stage busy-time imbalance
(max/mean over ranks) beside the planner's prediction (`vocabpipe plan --format json`, the
Simulate of the same plan with FLOP-proportional costs).

usage: pipeline_bench.py --vocabpipe BUILD/client/vocabpipe [--layers 4] [--hidden 256]
         [--seq 256] [--vocab 131072] [--microbatches 8] [--pipeline 2] [--steps 3]
         [--methods baseline,redis,interlaced,vocab1,vocab2] [--threads 1] [--workdir DIR]
         [--arch gpt2|llama] [--kv-heads N] [--ffn N]

Steps after the first (warm-up) are averaged. Prints a markdown table.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile


def run(cmd):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocabpipe", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--pipeline", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--methods", default="baseline,redis,interlaced,vocab1,vocab2")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--arch", default="gpt2", help="gpt2 or llama (RMSNorm, RoPE, SwiGLU, GQA)")
    ap.add_argument("--kv-heads", type=int, default=0, help="llama: key/value heads (0 = heads)")
    ap.add_argument("--ffn", type=int, default=0, help="ffn_hidden (0 = the architecture's default)")
    a = ap.parse_args()

    work = a.workdir or tempfile.mkdtemp(prefix="vp_pipeline_bench_")
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "data.bin")
    tokens = max(200000, a.seq * a.microbatches * (a.steps + 1) * 2)
    run([a.vocabpipe, "data", "synth", "--vocab", str(a.vocab), "--tokens", str(tokens),
         "--out", data, "--seed", "1"])
    rows = []
    for method in a.methods.split(","):
        spec = os.path.join(work, f"{method}.yaml")
        extra = f", architecture: {a.arch}"
        if a.arch == "llama" and a.kv_heads > 0:
            extra += f", kv_heads: {a.kv_heads}"
        if a.ffn > 0:
            extra += f", ffn_hidden: {a.ffn}"
        with open(spec, "w") as f:
            f.write(
                f"model: {{layers: {a.layers}, hidden: {a.hidden}, heads: {a.heads}, "
                f"vocab_size: {a.vocab}, seq_len: {a.seq}{extra}}}\n"
                f"parallel: {{pipeline: {a.pipeline}, schedule: {a.schedule}, vocab: {method}, "
                f"microbatches: {a.microbatches}}}\n"
                f"train: {{steps: {a.steps}, threads: {a.threads}}}\n"
                f"data: {{path: {data}}}\n"
                f"checkpoint: {{dir: {os.path.join(work, method)}, every: 1000000}}\n")
        plan = json.loads(run([a.vocabpipe, "plan", spec, "--format", "json"]))
        busy = [r["busy"] for r in plan["ranks"]]
        pred_imb = max(busy) / statistics.mean(busy)
        run([a.vocabpipe, "run", spec, "--direct", "--timeout", "600"])
        with open(os.path.join(work, method, "metrics.jsonl")) as f:
            steps = [json.loads(line) for line in f][1:] or None
        # The final checkpoint is not measured; at V = 128k it is gigabytes per method.
        for entry in os.listdir(os.path.join(work, method)):
            if entry.startswith("step_"):
                shutil.rmtree(os.path.join(work, method, entry))
        if steps is None:
            sys.exit("need --steps >= 2 (the first step is warm-up)")
        secs = statistics.mean(s["step_seconds"] for s in steps)
        tps = statistics.mean(s["tokens_per_s"] for s in steps)
        imb = statistics.mean(s["busy_max_over_mean"] for s in steps)
        mem = statistics.mean(s["memory_max_over_min"] for s in steps)
        peak = max(s["peak_memory_bytes"] for s in steps)
        rows.append((method, secs, tps, imb, plan["step_time"], pred_imb, mem, peak))
    base_secs = rows[0][1]
    base_pred = rows[0][4]
    print(f"{a.arch} p={a.pipeline} {a.schedule} L={a.layers} h={a.hidden} s={a.seq} V={a.vocab} "
          f"m={a.microbatches} b=1, {a.threads} BLAS thread(s) per rank, "
          f"{a.steps - 1} timed steps\n")
    print("| method | step s | tokens/s | busy max/mean | predicted busy max/mean | "
          f"speedup vs {rows[0][0]} | predicted speedup | mem max/min | peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method, secs, tps, imb, pred, pred_imb, mem, peak in rows:
        print(f"| {method} | {secs:.2f} | {tps:.0f} | {imb:.2f} | {pred_imb:.2f} | "
              f"{base_secs / secs:.2f} | {base_pred / pred:.2f} | {mem:.2f} | "
              f"{peak / 1048576:.0f} |")


if __name__ == "__main__":
    main()
