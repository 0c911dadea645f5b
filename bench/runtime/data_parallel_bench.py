#!/usr/bin/env python3
"""Data-parallel benchmark: at a fixed global batch (d x m microbatches per step), real
`vocabpipe run --direct` launches of one process (d=1, p=1), a two-stage pipeline (d=1, p=2),
two replicas (d=2, p=1) and two replicas with ZeRO-1, side by side: tokens/s, each rank's busy
share, the gradient reduction's exposed seconds (OPT's data-parallel collectives, not
overlapped), peak memory and optimizer bytes per rank, and the planner's prediction
(`vocabpipe plan --format json`: step time, and per rank state + activation bytes).

usage: data_parallel_bench.py --vocabpipe BUILD/client/vocabpipe [--layers 4] [--hidden 256]
         [--heads 4] [--seq 256] [--vocab 32768] [--global-microbatches 8] [--steps 4]
         [--threads 1] [--workdir DIR]

Steps after the first (warm-up) are averaged. Every rank gets --threads BLAS threads, so the
two-rank configurations use twice the cores of d=1, p=1. Prints a markdown table.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

from pipeline_bench import run  # runs a command, exits with its output when it fails


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocabpipe", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--global-microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workdir", default="")
    a = ap.parse_args()
    if a.steps < 2:
        sys.exit("need --steps >= 2 (the first step is warm-up)")

    work = a.workdir or tempfile.mkdtemp(prefix="vp_data_parallel_bench_")
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "data.bin")
    tokens = max(200000, a.seq * a.global_microbatches * (a.steps + 1) * 2)
    run([a.vocabpipe, "data", "synth", "--vocab", str(a.vocab), "--tokens", str(tokens),
         "--out", data, "--seed", "1"])
    configs = [("d=1 p=1", 1, 1, 0), ("d=1 p=2", 1, 2, 0), ("d=2 p=1", 2, 1, 0),
               ("d=2 p=1 ZeRO-1", 2, 1, 1)]
    rows = []
    for name, d, p, zero in configs:
        tag = name.replace(" ", "_").replace("=", "").replace("-", "")
        m = a.global_microbatches // d
        spec = os.path.join(work, f"{tag}.yaml")
        with open(spec, "w") as f:
            f.write(
                f"model: {{layers: {a.layers}, hidden: {a.hidden}, heads: {a.heads}, "
                f"vocab_size: {a.vocab}, seq_len: {a.seq}}}\n"
                f"parallel: {{pipeline: {p}, data: {d}, zero: {zero}, microbatches: {m}}}\n"
                f"train: {{steps: {a.steps}, threads: {a.threads}}}\n"
                f"data: {{path: {data}}}\n"
                f"checkpoint: {{dir: {os.path.join(work, tag)}, every: 1000000}}\n")
        plan = json.loads(run([a.vocabpipe, "plan", spec, "--format", "json"]))
        pred_mem = [r["state_bytes"] + r["peak_activation_bytes"] for r in plan["ranks"]]
        run([a.vocabpipe, "run", spec, "--direct", "--timeout", "600"])
        with open(os.path.join(work, tag, "metrics.jsonl")) as f:
            steps = [json.loads(line) for line in f][1:]
        for entry in os.listdir(os.path.join(work, tag)):
            if entry.startswith("step_"):
                shutil.rmtree(os.path.join(work, tag, entry))
        secs = statistics.mean(s["step_seconds"] for s in steps)
        tps = statistics.mean(s["tokens_per_s"] for s in steps)
        stages = steps[-1].get("stages") or []
        if stages:
            busy = [statistics.mean(s["stages"][r]["busy_seconds"] / s["step_seconds"]
                                    for s in steps) for r in range(len(stages))]
            reduction = [statistics.mean(s["stages"][r].get("data_parallel_seconds", 0)
                                         for s in steps) for r in range(len(stages))]
            peak = [max(s["stages"][r]["memory"].get("footprint", s["stages"][r]["memory"]["total"])
                        for s in steps) for r in range(len(stages))]
            opt = [stages[r]["memory"]["optimizer"] for r in range(len(stages))]
            engine = [max(s["stages"][r]["memory"]["total"] for s in steps)
                      for r in range(len(stages))]
            stage_of = [stages[r].get("stage", r) for r in range(len(stages))]
        else:  # one process: the step line itself
            busy = [None]
            reduction = [0.0]
            peak = [max(s["peak_memory_bytes"] for s in steps)]
            opt = [steps[-1]["memory"]["optimizer"]]
            # The one-process line has the categories' peaks, not their joint peak: their sum.
            engine = [max(sum(s["memory"][k] for k in ("parameters", "gradients", "optimizer",
                                                       "activations")) for s in steps)]
            stage_of = [0]
        rows.append((name, secs, tps, busy, reduction, peak, engine, opt,
                     [pred_mem[st] for st in stage_of], plan["step_time"],
                     plan.get("data_parallel_seconds", 0.0)))
    print(f"gpt2 L={a.layers} h={a.hidden} s={a.seq} V={a.vocab} b=1, "
          f"{a.global_microbatches} microbatches per step in all, {a.threads} BLAS thread(s) per "
          f"rank, {a.steps - 1} timed steps\n")
    print("| config | step s | tokens/s | busy share per rank | reduction s per rank "
          "(exposed) | process peak MiB per rank | engine peak MiB per rank | predicted MiB per rank "
          "| optimizer MiB per rank | predicted step (FLOP units) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    mib = lambda v: f"{v / 1048576:.0f}"
    for name, secs, tps, busy, red, peak, engine, opt, pred, pstep, pred_red in rows:
        share = " / ".join("—" if b is None else f"{100 * b:.0f}%" for b in busy)
        print(f"| {name} | {secs:.2f} | {tps:.0f} | {share} | "
              f"{' / '.join(f'{r:.3f}' for r in red)} | {' / '.join(mib(v) for v in peak)} | "
              f"{' / '.join(mib(v) for v in engine)} | "
              f"{' / '.join(mib(v) for v in pred)} | {' / '.join(f'{v / 1048576:.1f}' for v in opt)} "
              f"| {pstep:.4g} |")


if __name__ == "__main__":
    main()
