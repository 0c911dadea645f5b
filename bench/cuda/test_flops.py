#!/usr/bin/env python3
"""Device-free check (ctest cuda_bench.TorchBaselineCountsMatch): torch_baseline.py counts the
same model FLOPs, tokens and parameters as cuda_bench (whose formulas are proto/plan/flops.h,
the ones worker/runtime/flops.cc uses) for every model perf.sh measures, with the flags
torch_baseline.py itself gives cuda_bench.

Usage: test_flops.py CUDA_BENCH
"""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_baseline as tb  # noqa: E402 (imports without torch)


def fields(line):
    return dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)


def main():
    bench = sys.argv[1]
    bad = 0
    for name, c in tb.MODELS.items():
        out = subprocess.run([bench, "--print-flops"] + tb.cuda_bench_flags(c), check=True,
                             capture_output=True, text=True).stdout
        got = fields(next(l for l in out.splitlines() if l.startswith("FLOPS ")))
        want = {"layer_per_microbatch": tb.layer_flops(c, c["batch"]), "step": tb.flops(c),
                "tokens_per_step": tb.tokens_per_step(c), "params": tb.param_count(c)}
        for key, value in want.items():
            if float(got[key]) != float(value):
                print(f"{name}: {key}: cuda_bench {got[key]}, torch_baseline {value}")
                bad += 1
        print(f"{name}: step {tb.flops(c):.6g} FLOPs, {tb.param_count(c)} parameters: "
              f"{'match' if not bad else 'MISMATCH'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
