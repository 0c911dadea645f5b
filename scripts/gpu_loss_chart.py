#!/usr/bin/env python3
"""Loss curves of a GPU run (run.sh's logs) and its agreement with the CPU references, as one
SVG drawn with matplotlib (Debian's python3-matplotlib).

usage: gpu_loss_chart.py LOGS OUT.svg [--refs REFS] [--title TEXT]

LOGS: an unpacked run.sh log archive (the logs/ folder of docs/gpu-runs/DATE/runN/logs.tgz:
runs/NAME/metrics.jsonl and compare.txt). Left: the loss per step of the p = 1 runs
(gpu-p1-fp32, gpu-p1-bf16 and, when present, gpu-p1-bf16-fma / gpu-p1-bf16-tc). Right:
|cuda - cpu| / cpu per step for the fp32 jobs checked against a CPU reference (log scale), with
the 1e-4 acceptance limit: from the bundle's refs/ when --refs names it (exact), else from the
per-step differences compare.txt recorded (two significant digits; an exact match, 0, is drawn
at the axis floor).
"""

import argparse
import json
import os
import re

import matplotlib

matplotlib.use("agg")  # lays the text out; savefig writes SVG
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import LogLocator, MaxNLocator  # noqa: E402

plt.rcParams.update({
    "svg.hashsalt": "vocabpipe-gpu-loss-chart",
    "svg.fonttype": "path",
    "font.family": "DejaVu Sans",
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.titlelocation": "left",
    "axes.spines.top": False,
    "axes.spines.right": False,
})

COLORS = {"gpu-p1-fp32": "#4477aa", "gpu-p1-bf16": "#ee6677", "gpu-p1-bf16-fma": "#ccbb44",
          "gpu-p1-bf16-tc": "#ccbb44", "gpu-p2-vocab1": "#228833", "gpu-p2-vocab2": "#aa3377",
          "gpu-llama-p2": "#66ccee"}
FLOOR = 1e-11  # an exact match on the log axis


def load(folder, name):
    path = os.path.join(folder, name, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        lines = [json.loads(l) for l in f if l.strip()]
    return sorted(lines, key=lambda l: l["step"])


def recorded_differences(compare_txt):
    """{job: [relative difference per step]} from compare.txt's "loss difference by step"."""
    out = {}
    if not os.path.exists(compare_txt):
        return out
    pat = re.compile(r"^INFO (\S+) loss difference by step: .*; per step (.*)$")
    with open(compare_txt) as f:
        for line in f:
            m = pat.match(line.strip())
            if m:
                out[m.group(1)] = [float(v) for v in m.group(2).split()]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs")
    ap.add_argument("out")
    ap.add_argument("--refs", default="")
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    runs_dir = os.path.join(a.logs, "runs")
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))

    # Left: loss per step of the p = 1 runs.
    for name in ["gpu-p1-fp32", "gpu-p1-bf16", "gpu-p1-bf16-fma", "gpu-p1-bf16-tc"]:
        r = load(runs_dir, name)
        if r:
            left.plot([l["step"] for l in r], [l["loss"] for l in r], color=COLORS[name],
                      linewidth=1.2, label=name.replace("gpu-p1-", "cuda "))
    left.set_title("Loss per step (p = 1, one H100)")
    left.set_xlabel("step")
    left.set_ylabel("loss")
    left.xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True, steps=[1, 2, 5, 10]))
    left.yaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 5, 10]))
    left.set_xlim(left=0)
    left.grid(color="#dddddd", linewidth=0.6)
    left.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)

    # Right: relative difference to the CPU per step.
    recorded = recorded_differences(os.path.join(a.logs, "compare.txt"))
    for name in ["gpu-p1-fp32", "gpu-p2-vocab1", "gpu-p2-vocab2", "gpu-llama-p2"]:
        diffs = None
        if a.refs:
            got, want = load(runs_dir, name), load(a.refs, name + "-cpu")
            if got and want:
                n = min(len(got), len(want))
                diffs = [abs(got[s]["loss"] - want[s]["loss"]) / abs(want[s]["loss"])
                         for s in range(n)]
        elif name in recorded:
            diffs = recorded[name]
        if diffs:
            right.plot(range(len(diffs)), [max(d, FLOOR) for d in diffs], color=COLORS[name],
                       linewidth=1.2, marker="o", markersize=2.5, label=name)
    right.axhline(1e-4, color="#cc3311", linestyle="--", linewidth=1, label="acceptance limit 1e-4")
    right.set_yscale("log")
    right.set_ylim(FLOOR / 2, 1e-3)
    right.yaxis.set_major_locator(LogLocator(base=10, numticks=10))
    right.set_title("|cuda fp32 − cpu| / cpu per step" +
                    ("" if a.refs else " (as compare.txt recorded it)"))
    right.set_xlabel("step")
    right.set_ylabel("relative difference")
    right.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True, steps=[1, 2, 5, 10]))
    right.set_xlim(left=0)
    right.grid(color="#dddddd", linewidth=0.6)
    right.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)

    if a.title:
        fig.text(0.5, 0.01, a.title, ha="center", fontsize=9)
    fig.tight_layout(rect=(0, 0.05 if a.title else 0, 1, 1))
    fig.savefig(a.out, format="svg", metadata={"Date": None})


if __name__ == "__main__":
    main()
