#!/usr/bin/env python3
"""make demo-text's loss curve, drawn with matplotlib (Debian's python3-matplotlib).

usage: demo_text_chart.py RUN_DIR ENTROPY OUT.svg

RUN_DIR/metrics.jsonl: the run's step lines (loss per step; val_loss on the evaluated steps);
ENTROPY: the unigram entropy of the validation split (nats/token), drawn as a dashed line.
Steps are numbered from 1 as the run prints them. Ticks fall on round numbers (whole steps),
the legend sits outside the axes, and the SVG is stable (fixed hash salt, no date).
"""
import json
import sys

import matplotlib

matplotlib.use("agg")  # lays the text out; savefig writes SVG
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

plt.rcParams.update({
    "svg.hashsalt": "vocabpipe-demo-text-chart",
    "svg.fonttype": "path",
    "font.family": "DejaVu Sans",
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.titlelocation": "left",
    "axes.spines.top": False,
    "axes.spines.right": False,
})


def main(argv):
    if len(argv) != 4:
        sys.stderr.write("usage: demo_text_chart.py RUN_DIR ENTROPY OUT.svg\n")
        return 2
    run, entropy, out = argv[1], float(argv[2]), argv[3]
    with open(run + "/metrics.jsonl") as f:
        lines = [json.loads(l) for l in f if l.strip()]
    steps = [l["step"] + 1 for l in lines]
    train = [l["loss"] for l in lines]
    val = [(l["step"] + 1, l["val_loss"]) for l in lines if "val_loss" in l]

    fig, ax = plt.subplots(figsize=(9, 4.6))
    ax.plot(steps, train, color="#4477aa", linewidth=0.9, label="training loss")
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], color="#cc3311", linewidth=2,
                marker="o", markersize=4, label="validation loss")
    ax.axhline(entropy, color="gray", linestyle="--", linewidth=1,
               label=f"unigram entropy {entropy:.2f}")
    ax.set_title("demo-text: GPT-2 (4 layers, h 128) on the King James Bible, 2 ranks, Vocab-1")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True, steps=[1, 2, 5, 10]))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=7, steps=[1, 2, 5, 10]))
    ax.set_xlim(0, steps[-1])
    ax.grid(color="#e4e4e4", linewidth=0.6)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(out, format="svg", metadata={"Date": None})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
