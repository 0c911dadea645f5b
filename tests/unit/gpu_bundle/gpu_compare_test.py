#!/usr/bin/env python3
"""gpu_compare.py against metrics written here (no GPU): the CPU references come from --refs,
a job the control plane failed is read from its --direct retry, the 1e-4 loss limit and the
3% bf16 limit fail when exceeded, and a missing run is a FAIL naming it.

usage: gpu_compare_test.py PATH/TO/gpu_compare.py
"""

import json
import math
import os
import subprocess
import sys
import tempfile

EQUAL = ["gpu-p1-fp32", "gpu-p2-vocab1", "gpu-p2-vocab2", "gpu-llama-p2"]
GATED = ["gpu-d2-p2", "gpu-t2-p2"]  # compared only when the GPU run exists


def write(folder, name, losses, stages=()):
    os.makedirs(os.path.join(folder, name), exist_ok=True)
    with open(os.path.join(folder, name, "metrics.jsonl"), "w") as f:
        for step, loss in enumerate(losses):
            f.write(json.dumps({"step": step, "loss": loss, "grad_norm": 1.0 + loss / 100,
                                "tokens_per_s": 1000.0, "step_seconds": 0.1, "mfu": 0.01,
                                "stages": list(stages)}) + "\n")


def curve(steps, start=8.3, end=3.0):
    return [end + (start - end) * math.exp(-i / 40) for i in range(steps)]


def run(compare, *args):
    r = subprocess.run([sys.executable, compare, *args], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def lines(out, verdict):
    return [l for l in out.splitlines() if l.startswith(verdict + " ")]


def expect(cond, what, out):
    if not cond:
        print(f"FAILED: {what}\n--- output ---\n{out}")
        sys.exit(1)


def main():
    compare = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        runs, refs = os.path.join(tmp, "runs"), os.path.join(tmp, "refs")
        ref = curve(20)
        for name in EQUAL + GATED:
            write(refs, name + "-cpu", ref)
        # p1 fp32 through the control plane; p2 vocab1 only as a --direct retry.
        write(runs, "gpu-p1-fp32", curve(200))
        write(runs, "gpu-p2-vocab1-direct", [l * (1 + 2e-5) for l in ref])
        write(runs, "gpu-p2-vocab2", [l * (1 + 5e-4) for l in ref])  # over the 1e-4 limit
        write(runs, "gpu-p1-bf16", [l * 1.01 for l in curve(200)])  # within 3%
        # Opt-in kernel reruns of the bf16 job, found by name: one through the control plane,
        # one only as a --direct retry.
        write(runs, "gpu-p1-bf16-vector", [l * 1.02 for l in curve(200)])
        write(runs, "gpu-p1-bf16-gelu-direct", [l * 1.005 for l in curve(200)])
        # t = 2 ran (its rule lifted), d = 2 was refused at submit: no run folder.
        ranks = [{"replica": 0, "tensor": t, "stage": p, "memory": {"total": (3 + t) << 20},
                  "predicted_memory_total": 4 << 20} for t in range(2) for p in range(2)]
        write(runs, "gpu-t2-p2", [l * (1 + 1e-6) for l in ref], ranks)
        rc, out = run(compare, runs, "--refs", refs, "--cpu-steps", "20")
        expect(rc == 1, "exit 1 when a check failed", out)
        expect(any(l.startswith("PASS gpu-p1-fp32 cuda fp32 = cpu") for l in lines(out, "PASS")),
               "p1 fp32 compared with the reference from --refs", out)
        expect(any(l.startswith("PASS gpu-p2-vocab1 cuda fp32 = cpu") for l in lines(out, "PASS")),
               "p2 vocab1 read from its -direct retry", out)
        expect(any(l.startswith("FAIL gpu-p2-vocab2 cuda fp32 = cpu") and "5.00e-04" in l
                   for l in lines(out, "FAIL")), "5e-4 relative fails the 1e-4 limit", out)
        expect(any(l.startswith("FAIL gpu-llama-p2 cuda fp32 = cpu") and
                   "no metrics.jsonl for gpu-llama-p2" in l for l in lines(out, "FAIL")),
               "a missing run fails, named", out)
        expect(any(l.startswith("PASS gpu-p1-bf16 learns like fp32") for l in lines(out, "PASS")),
               "bf16 1% above fp32 passes the 3% limit", out)
        for variant in ("gpu-p1-bf16-vector", "gpu-p1-bf16-gelu"):
            expect(any(l.startswith(f"PASS {variant} learns like fp32") for l in lines(out, "PASS")),
                   f"the rerun {variant} is found and checked like gpu-p1-bf16", out)
        expect("gpu-p1-bf16-gelu-direct learns" not in out, "a --direct retry is its job's run", out)
        expect(any(l.startswith("INFO gpu-p1-fp32 loss difference by step") for l in
                   lines(out, "INFO")), "the per-step difference is reported", out)
        expect(any(l.startswith("PASS gpu-t2-p2 cuda fp32 = cpu") for l in lines(out, "PASS")),
               "a gated job that ran is compared", out)
        expect("gpu-d2-p2 cuda fp32" not in out, "a gated job refused at submit is not", out)
        expect(any(l.startswith("INFO gpu-t2-p2 memory per rank") and
                   "(0, 1, 1): 4.0 MiB (predicted 4.0)" in l for l in lines(out, "INFO")),
               "memory per rank (replica, tensor, stage) beside the prediction", out)

        write(runs, "gpu-p1-bf16", [l * 1.05 for l in curve(200)])  # 5% above fp32
        rc, out = run(compare, runs, "--refs", refs, "--cpu-steps", "20")
        expect(any(l.startswith("FAIL gpu-p1-bf16 learns like fp32") for l in lines(out, "FAIL")),
               "bf16 5% above fp32 fails the 3% limit", out)

        # The dry run: only the references, which must exist with the right number of steps.
        rc, out = run(compare, runs, "--refs", refs, "--cpu-steps", "20", "--cpu-only")
        expect(rc == 0 and len(lines(out, "PASS")) == 6, "dry run: six references pass", out)
        rc, out = run(compare, runs, "--refs", refs, "--cpu-steps", "3", "--cpu-only")
        expect(rc == 1, "dry run: a reference of the wrong length fails", out)
    print("gpu_compare_test: all checks passed")


if __name__ == "__main__":
    main()
