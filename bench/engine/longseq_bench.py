#!/usr/bin/env python3
"""Long-sequence training on the CPU engine (issue 32): peak memory and tokens/s of real
`vocabpipe run --direct` jobs at long s, and per-rank memory against the planner's prediction
for Seq1F1B.

usage: longseq_bench.py --vocabpipe BUILD/client/vocabpipe --seq 2048,8192,32768
         [--pipeline 1] [--seq-chunks 1] [--schedule 1f1b] [--layers 2] [--hidden 128]
         [--heads 4] [--vocab 1000] [--microbatches 1] [--steps 2] [--threads 2]
         [--workdir DIR] [--label NAME]

One row per (s, k). The model is GPT-2 with b = 1. The last step is the timed one (the first
is warm-up). Columns: the step's seconds and tokens/s; the engine's peak (the allocator's
per-category peaks summed; with p > 1 the largest rank's total); the peak the run reports (max of that and the
process's peak RSS, `peak_memory_bytes`); the peak RSS of the largest process as the kernel
saw it (`/usr/bin/time`); and, with p > 1, each rank's measured total beside the planner's
prediction (`stages[].memory.total`, `stages[].predicted_memory_total`).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

MIB = 1048576.0


def run(cmd):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-4000:]}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocabpipe", required=True)
    ap.add_argument("--seq", default="2048,8192,32768")
    ap.add_argument("--seq-chunks", default="1", help="k values, comma-separated")
    ap.add_argument("--pipeline", type=int, default=1)
    ap.add_argument("--schedule", default="")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--label", default="")
    a = ap.parse_args()

    work = a.workdir or tempfile.mkdtemp(prefix="vp_longseq_bench_")
    os.makedirs(work, exist_ok=True)
    seqs = [int(s) for s in a.seq.split(",")]
    data = os.path.join(work, "data.bin")
    tokens = max(200000, max(seqs) * a.microbatches * (a.steps + 1) * 2)
    run([a.vocabpipe, "data", "synth", "--vocab", str(a.vocab), "--tokens", str(tokens),
         "--out", data, "--seed", "1"])
    print(f"{a.label} GPT-2 p={a.pipeline} L={a.layers} h={a.hidden} heads={a.heads} "
          f"V={a.vocab} b=1 m={a.microbatches}, {a.threads} thread(s) per rank\n")
    print("| s | k | step s | tokens/s | engine peak MiB | reported peak MiB | max RSS MiB | "
          "per-rank measured / predicted MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for s in seqs:
        for k in [int(x) for x in a.seq_chunks.split(",")]:
            name = f"s{s}-k{k}-p{a.pipeline}"
            out_dir = os.path.join(work, name)
            schedule = a.schedule or ("seq1f1b" if k > 1 else "1f1b")
            spec = os.path.join(work, f"{name}.yaml")
            with open(spec, "w") as f:
                f.write(
                    f"model: {{layers: {a.layers}, hidden: {a.hidden}, heads: {a.heads}, "
                    f"vocab_size: {a.vocab}, seq_len: {s}}}\n"
                    f"parallel: {{pipeline: {a.pipeline}, schedule: {schedule}, vocab: vocab2, "
                    f"seq_chunks: {k}, microbatch_size: 1, microbatches: {a.microbatches}}}\n"
                    f"train: {{steps: {a.steps}, threads: {a.threads}}}\n"
                    f"data: {{path: {data}}}\n"
                    f"checkpoint: {{dir: {out_dir}, every: 1000000}}\n"
                    f"device: cpu\n")
            # GNU time's maximum RSS is the largest of the process and its waited-for
            # children: the biggest rank's.
            log = run(["/usr/bin/time", "-v", a.vocabpipe, "run", "--direct", spec,
                       "--timeout", "3600"])
            rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", log).group(1))
            with open(os.path.join(out_dir, "metrics.jsonl")) as f:
                last = [json.loads(line) for line in f][-1]
            mem = last.get("memory", {})
            engine = sum(mem.get(c, 0) for c in ("parameters", "gradients", "optimizer",
                                                 "activations"))
            ranks = ""
            if "stages" in last:
                ranks = ", ".join(
                    f"{st['memory']['total'] / MIB:.0f} / "
                    f"{st.get('predicted_memory_total', 0) / MIB:.0f}"
                    for st in last["stages"])
                engine = max(st["memory"]["total"] for st in last["stages"])
            print(f"| {s} | {k} | {last['step_seconds']:.1f} | {last['tokens_per_s']:.0f} | "
                  f"{engine / MIB:.0f} | {last['peak_memory_bytes'] / MIB:.0f} | "
                  f"{rss / 1024:.0f} | {ranks} |", flush=True)
            for entry in os.listdir(out_dir):
                if entry.startswith("step_"):
                    shutil.rmtree(os.path.join(out_dir, entry))


if __name__ == "__main__":
    main()
