#!/usr/bin/env python3
"""Layout-choice benchmark: is the planner's pick for a world of N ranks the fastest measured?

For a job with `parallel.world: N` and every axis (pipeline, data, tensor) and the
recomputation left `auto`, `vocabpipe plan --explain` lists every candidate layout with its
predicted step time and peak bytes a rank. Each candidate the planner could plan is then run for
real (`vocabpipe run --direct`, its axes fixed, the step's microbatches split over its d
replicas) and measured: tokens/s (mean of the steps after the first) and the largest rank's
activation peak (the engine's tracker) beside the planner's prediction for it. The table marks
the planner's choice and the best measured layout; the last line says how far the choice's
measured tokens/s is from the best one's.

usage: layout_bench.py --vocabpipe BUILD/client/vocabpipe [--world 4] [--layers 4]
         [--hidden 128] [--heads 4] [--seq 128] [--vocab 8192] [--microbatch-size 2]
         [--global-microbatches 8] [--steps 4] [--budget BYTES] [--modes none,selective,full]
         [--workdir DIR]

Every rank gets one BLAS thread (the ranks share this machine's cores). Prints markdown.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

from pipeline_bench import run  # runs a command, exits with its output when it fails


def parse_table(text):
    """The planned rows of `vocabpipe plan --explain`'s layout table."""
    rows, chosen = [], None
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("rank ") and "tokens/s" in l)
    for line in lines[start + 1:]:
        if not line.strip():
            break
        f = line.split()
        if not f[0].isdigit():
            continue  # refused: not planned
        row = {"d": int(f[1]), "t": int(f[2]), "p": int(f[3]), "recompute": f[4],
               "schedule": f[5], "vocab": f[6], "k": int(f[7]), "step_s": float(f[8]),
               "tokens_s": float(f[9]), "peak": int(f[10]), "fits": f[11] == "yes"}
        if "<- chosen" in line:
            chosen = row
        rows.append(row)
    return rows, chosen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocabpipe", required=True)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--global-microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget", type=int, default=0)
    ap.add_argument("--modes", default="none,selective,full")
    ap.add_argument("--workdir", default="")
    a = ap.parse_args()
    if a.steps < 2:
        sys.exit("need --steps >= 2 (the first step is warm-up)")
    modes = a.modes.split(",")

    work = a.workdir or tempfile.mkdtemp(prefix="vp_layout_bench_")
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "data.bin")
    tokens = max(200000, a.seq * a.microbatch_size * a.global_microbatches * (a.steps + 1) * 2)
    run([a.vocabpipe, "data", "synth", "--vocab", str(a.vocab), "--tokens", str(tokens),
         "--out", data, "--seed", "1"])

    def write_spec(path, parallel, run_dir):
        with open(path, "w") as f:
            f.write(
                f"model: {{layers: {a.layers}, hidden: {a.hidden}, heads: {a.heads}, "
                f"vocab_size: {a.vocab}, seq_len: {a.seq}}}\n"
                f"parallel: {{{parallel}, microbatch_size: {a.microbatch_size}, "
                f"memory_budget_bytes: {a.budget}}}\n"
                f"train: {{steps: {a.steps}, threads: 1}}\n"
                f"data: {{path: {data}}}\n"
                f"checkpoint: {{dir: {run_dir}, every: 1000000}}\n")

    world_spec = os.path.join(work, "world.yaml")
    write_spec(world_spec,
               f"world: {a.world}, pipeline: auto, data: auto, tensor: auto, recompute: auto, "
               f"microbatches: {a.global_microbatches}, schedule: 1f1b, vocab: vocab2",
               os.path.join(work, "world"))
    explained = run([a.vocabpipe, "plan", world_spec, "--explain"])
    candidates, chosen = parse_table(explained)
    if chosen is None:
        sys.exit("the plan chose no layout:\n" + explained)

    rows = []
    for c in candidates:
        if c["recompute"] not in modes and c is not chosen:
            continue
        tag = f"d{c['d']}_t{c['t']}_p{c['p']}_{c['recompute']}"
        spec = os.path.join(work, f"{tag}.yaml")
        run_dir = os.path.join(work, tag)
        write_spec(spec,
                   f"pipeline: {c['p']}, data: {c['d']}, tensor: {c['t']}, "
                   f"recompute: {c['recompute']}, microbatches: {a.global_microbatches // c['d']}, "
                   f"schedule: {c['schedule']}, vocab: {c['vocab']}, seq_chunks: {c['k']}",
                   run_dir)
        run([a.vocabpipe, "run", spec, "--direct", "--timeout", "900"])
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            steps = [json.loads(line) for line in f][1:]
        for entry in os.listdir(run_dir):
            if entry.startswith("step_"):
                shutil.rmtree(os.path.join(run_dir, entry))
        tps = statistics.mean(s["tokens_per_s"] for s in steps)
        # The largest rank's engine peak (weights, gradients, optimizer state, activations)
        # beside the planner's prediction for it (the engine's measured layer bytes under the
        # run's recomputation mode: what `run --direct` plans with).
        stages = steps[-1].get("stages") or []
        if not stages:
            sys.exit(f"{tag}: no per-rank lines in metrics.jsonl")
        peak, pred = 0, 0
        for r in range(len(stages)):
            measured = max(s["stages"][r]["memory"]["total"] for s in steps)
            if measured > peak:
                peak, pred = measured, stages[r].get("predicted_memory_total", 0)
        rows.append((c, tps, peak, pred))

    # The best measured among the layouts that really fit the budget (all without one).
    fitting = [r for r in rows if a.budget <= 0 or r[2] <= a.budget] or rows
    best = max(fitting, key=lambda r: r[1])
    mine = next(r for r in rows if r[0] is chosen)
    print(f"gpt2 L={a.layers} h={a.hidden} heads={a.heads} s={a.seq} V={a.vocab} "
          f"b={a.microbatch_size}, {a.global_microbatches} microbatches a step, world {a.world}, "
          f"one BLAS thread a rank, {a.steps - 1} timed steps, budget {a.budget or 'none'}\n")
    print("| layout (d, t, p) | recompute | schedule/vocab | predicted step (FLOP units) | "
          "predicted tokens/s | measured tokens/s | largest rank's peak MiB measured / predicted |")
    print("|---|---|---|---|---|---|---|")
    for c, tps, act, pred_act in sorted(rows, key=lambda r: r[0]["step_s"]):
        mark = (" **chosen**" if c is chosen else "") + (" **best measured**" if c is best[0] else "")
        print(f"| ({c['d']}, {c['t']}, {c['p']}){mark} | {c['recompute']} | "
              f"{c['schedule']}/{c['vocab']} | {c['step_s']:.4g} | {c['tokens_s']:.4g} | "
              f"{tps:.0f} | {act / 1048576:.1f} / {pred_act / 1048576:.1f} |")
    print(f"\nchosen ({chosen['d']}, {chosen['t']}, {chosen['p']}) {chosen['recompute']}: "
          f"{mine[1]:.0f} tokens/s measured, {100 * mine[1] / best[1]:.1f}% of the best measured "
          f"({best[0]['d']}, {best[0]['t']}, {best[0]['p']}) {best[0]['recompute']}: "
          f"{best[1]:.0f} tokens/s")


if __name__ == "__main__":
    main()
