#!/usr/bin/python3
"""Checkpoint cost at scale (docs/benchmarks.md, "Checkpoints at scale"): rank 0's resident
memory while it trains and while it saves, and the seconds per GB of the save, the merged
export and the resume, for GPT-2 models of about 0.1B and 0.47B parameters (V = 32000, fp32,
tied embeddings) run as p = 2 `vocabpipe-worker` processes on this machine.

  python3 bench/checkpoint/checkpoint_bench.py --vocabpipe build/client/vocabpipe \
      [--sizes 0.1B,0.47B] [--work DIR] [--keep]

For each size:
  1. `vocabpipe run --direct` of 2 steps with the only save after the last step. Rank 0's VmRSS
     is sampled from outside every 10 ms (its pid from rank_0.pid); the training peak is the
     largest sample before step_2/ appears (the save starts), the save peak the largest after it
     until rank 0 exits (its shard written and verified, then the merge of both ranks' shards
     into the Hugging Face export). The rank's own VmHWM from its step lines is printed too.
  2. `vocabpipe export` of that step again (the merge alone), timed, with the CLI's peak RSS.
  3. `--resume` to step 3: rank 0's log line "resumed from step 2 in X s" (manifest check,
     headers, values checked, read into place).
Only the standard library; the machine needs about 3x the model's fp32 bytes of memory per
rank, and the disk about 4x per rank plus the export.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

SIZES = {
    # name: (layers, hidden)
    "0.1B": (6, 1024),
    "0.47B": (8, 2048),
    "1.5B": (24, 2240),
}
V = 32000


def params(layers, h):
    return 12 * layers * h * h + 13 * layers * h + V * h + 64 * h + 2 * h


def rss_of(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def spec(path, run, layers, h, steps):
    with open(path, "w") as f:
        f.write(
            f"model: {{layers: {layers}, hidden: {h}, heads: {h // 64}, vocab_size: {V}, "
            f"seq_len: 64, tie_embeddings: true}}\n"
            "parallel: {pipeline: 2, microbatch_size: 1, microbatches: 2, vocab: vocab2}\n"
            f"train: {{steps: {steps}, threads: 1}}\n"
            "data: {path: data.bin}\n"
            f"checkpoint: {{dir: {run}}}\n")


def dir_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            total += os.path.getsize(os.path.join(root, name))
    return total


def measure(vp, work, name, layers, h):
    run = os.path.join(work, f"run-{name}")
    shutil.rmtree(run, ignore_errors=True)
    path = os.path.join(work, f"{name}.yaml")
    spec(path, run, layers, h, 2)
    start = time.time()
    proc = subprocess.Popen([vp, "run", "--direct", path, "--timeout", "3600"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pid_file, step_dir = os.path.join(run, "rank_0.pid"), os.path.join(run, "step_2")
    pid, train_peak, save_peak = None, 0, 0
    save_start = merge_done = None
    while proc.poll() is None:
        if pid is None and os.path.exists(pid_file):
            try:
                pid = int(open(pid_file).read().strip() or 0) or None
            except (OSError, ValueError):
                pid = None
        if pid is not None:
            rss = rss_of(pid)
            if save_start is None and os.path.exists(step_dir):
                save_start = time.time()
            if rss is not None:
                if save_start is None:
                    train_peak = max(train_peak, rss)
                else:
                    save_peak = max(save_peak, rss)
            if merge_done is None and os.path.exists(os.path.join(step_dir, "DONE")):
                merge_done = time.time()
        time.sleep(0.01)
    out = proc.stdout.read()
    if proc.returncode != 0:
        sys.exit(f"{name}: vocabpipe run failed:\n{out}")
    lines = [json.loads(l) for l in open(os.path.join(run, "rank_0.jsonl"))]
    hwm = [l["memory"].get("process", 0) for l in lines]
    ckpt = lines[-1].get("checkpoint_seconds", 0.0)
    shard = dir_bytes(os.path.join(step_dir, "rank_0"))
    merged = sum(os.path.getsize(os.path.join(step_dir, f)) for f in os.listdir(step_dir)
                 if f.endswith(".safetensors"))
    # The merge alone, again: `vocabpipe export` (a process of its own: its peak is the merge's).
    t = time.time()
    exp = subprocess.run(["/usr/bin/time", "-f", "%M", vp, "export", run, "--step", "2"],
                         capture_output=True, text=True)
    export_s = time.time() - t
    if exp.returncode != 0:
        sys.exit(f"{name}: export failed:\n{exp.stderr}")
    export_rss = int(exp.stderr.strip().splitlines()[-1]) * 1024
    # The resume: one more step from the shards of step 2.
    spec(path, run, layers, h, 3)
    res = subprocess.run([vp, "run", "--direct", path, "--resume", "--timeout", "3600"],
                         capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"{name}: resume failed:\n{res.stdout}{res.stderr}")
    log = open(os.path.join(run, "rank_0.log")).read()
    m = re.findall(r"resumed from step 2 in ([0-9.]+) s", log)
    resume_s = float(m[-1]) if m else float("nan")
    gb = 1e9
    return {
        "model": name, "params": params(layers, h),
        "train_peak_mb": train_peak / 1e6, "save_peak_mb": save_peak / 1e6,
        "save_minus_train_mb": (save_peak - train_peak) / 1e6,
        "hwm_lines_mb": [x / 1e6 for x in hwm],
        "shard_gb": shard / gb, "merged_gb": merged / gb,
        "checkpoint_seconds": ckpt, "save_s_per_gb": ckpt / (shard / gb),
        "merge_seconds": (merge_done - save_start) if merge_done and save_start else None,
        "export_seconds": export_s, "export_s_per_gb": export_s / (merged / gb),
        "export_peak_rss_mb": export_rss / 1e6,
        "resume_seconds": resume_s, "resume_s_per_gb": resume_s / (shard / gb),
        "wall_seconds": time.time() - start,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocabpipe", default="build/client/vocabpipe")
    ap.add_argument("--sizes", default="0.1B,0.47B")
    ap.add_argument("--work", default=None)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    vp = os.path.abspath(a.vocabpipe)
    work = a.work or tempfile.mkdtemp(prefix="vp-ckpt-bench.")
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "data.bin")
    if not os.path.exists(data):
        subprocess.run([vp, "data", "synth", "--vocab", str(V), "--tokens", "100000", "--out",
                        data, "--seed", "3"], check=True, stdout=subprocess.DEVNULL)
    try:
        rows = []
        for name in a.sizes.split(","):
            layers, h = SIZES[name]
            r = measure(vp, work, name, layers, h)
            print(json.dumps(r), flush=True)
            rows.append(r)
            shutil.rmtree(os.path.join(work, f"run-{name}"), ignore_errors=True)
        print("\n| model | params | rank 0 training peak MB | save peak MB | save − training MB |"
              " shard GB | checkpoint_seconds | save s/GB | export GB | export s | export s/GB |"
              " export peak RSS MB | resume s | resume s/GB |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['model']} | {r['params'] / 1e9:.2f}B | {r['train_peak_mb']:.0f} |"
                  f" {r['save_peak_mb']:.0f} | {r['save_minus_train_mb']:+.0f} |"
                  f" {r['shard_gb']:.2f} | {r['checkpoint_seconds']:.1f} |"
                  f" {r['save_s_per_gb']:.1f} | {r['merged_gb']:.2f} |"
                  f" {r['export_seconds']:.1f} | {r['export_s_per_gb']:.1f} |"
                  f" {r['export_peak_rss_mb']:.0f} | {r['resume_seconds']:.1f} |"
                  f" {r['resume_s_per_gb']:.1f} |")
    finally:
        if not a.keep and not a.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
