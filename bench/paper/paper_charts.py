#!/usr/bin/env python3
"""paper_charts.py RESULTS.json IMG_DIR: draws bench/paper/paper_bench.py's results as SVG
charts with matplotlib (Debian's python3-matplotlib) and prints the markdown tables of
docs/benchmarks.md. Writes IMG_DIR/paper_vocab.svg, paper_vshape.svg, paper_seq.svg (and
paper_flat.svg) for the tables that have rows.

The charts read at a glance: y ticks on round numbers, values written as 1.08k (three
significant digits, thousands as k), group labels wrapped or slanted when they would touch,
legends outside the axes. The SVG is stable: a fixed hash salt and no date, so drawing the same
results twice writes the same bytes.
"""
import json
import sys
import textwrap

import matplotlib

matplotlib.use("agg")  # lays the text out; savefig writes SVG
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: E402

plt.rcParams.update({
    "svg.hashsalt": "vocabpipe-paper-charts",
    "svg.fonttype": "path",  # text as glyph outlines: the picture does not depend on the viewer's fonts
    "font.family": "DejaVu Sans",
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.titlelocation": "left",
    "axes.spines.top": False,
    "axes.spines.right": False,
})

COLORS = ["#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb"]
WIDTH_IN = 12.0  # 1200 px at 100 dpi
PANEL_IN = 2.9


def fmt(v):
    """A number as the charts write it: three significant digits, thousands as k, M, G
    (1080 -> 1.08k, 8600 -> 8.6k, 190 -> 190, 0.25 -> 0.25); never an exponent above 1e-3."""
    a = abs(v)
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= 0.9995 * scale:
            return f"{v / scale:.3g}{suffix}"
    if a != 0 and a < 1e-3:
        return f"{v:.1e}"
    return f"{v:.3g}"


# --- the markdown tables (the same columns as docs/benchmarks.md) ---------------------------

def smallest_vocab_rate(rows):
    """Model GFLOP/s of each (p, method) at the table's smallest V: the paper's "consistent MFU
    as V grows" is a row's rate against it."""
    rate, smallest = {}, {}
    for r in rows:
        if "model_gflops_per_s" not in r:
            continue
        key = (r["p"], r["vocab"])
        if key not in smallest or r["V"] < smallest[key]:
            smallest[key] = r["V"]
            rate[key] = r["model_gflops_per_s"]
    return rate


def rate_column(r, base):
    if "model_gflops_per_s" not in r:
        return "-"
    rate = r["model_gflops_per_s"]
    b = base.get((r["p"], r["vocab"]))
    if b is None:
        return "%.1f" % rate
    return "%.1f (%.2f)" % (rate, rate / b)


def table_row(r, base):
    peaks = "/".join("%.0f" % v for v in r["peak_mib_per_rank"])
    # The modelled communication (the busiest rank's lanes) and how far the timed steps spread
    # ((max - min) / mean): rows from before the link model have neither.
    comm = "%.3f" % max(r["predicted_comm_s_per_rank"]) if "predicted_comm_s_per_rank" in r else "-"
    spread = "-"
    if len(r.get("step_s_each", [])) > 1:
        each = r["step_s_each"]
        spread = "%.0f%%" % (100 * (max(each) - min(each)) / r["step_s"])
    busy = "%.2f" % r["busy_share"] if "busy_share" in r else "-"
    return ("| %d | %s | %s | %s | %d | %.3f | %.3f | **%+.0f%%** | %s | %s | %.0f | %.2f%% | %s | "
            "%s | %.2f | %.2f | %s |" % (
                r["p"], r["schedule"], "k=%d" % r["k"] if r["k"] > 1 else "-", r["vocab"], r["V"],
                r["step_s"], r["predicted_step_s"], 100 * r["gap"], comm, spread,
                r["tokens_per_s"], 100 * r["mfu"], rate_column(r, base), busy,
                r["busy_max_over_mean"], r["predicted_busy_max_over_mean"], peaks))


TABLE_HEAD = (
    "| p | schedule | k | vocab | V | step s | predicted s | gap | comm s | spread | tokens/s | "
    "MFU | GFLOP/s (vs V=32k) | busy share | busy max/mean | predicted | peak MiB per rank |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


# --- the charts ------------------------------------------------------------------------------

def grid(rows, group_of, series_of, value_of):
    """{group: {series: value}} in the rows' order, and the group and series names in order."""
    groups, series, cells = [], [], {}
    for r in rows:
        g, s = group_of(r), series_of(r)
        v = value_of(r)
        if v is None:
            continue
        if g not in groups:
            groups.append(g)
        if s not in series:
            series.append(s)
        cells[(g, s)] = v
    return groups, series, cells


def overlapping(labels, renderer, gap_px=4):
    boxes = [t.get_window_extent(renderer) for t in labels if t.get_text()]
    return any(a.x1 + gap_px > b.x0 for a, b in zip(boxes, boxes[1:]))


def bar_panel(ax, title, groups, series, cells, reference=None):
    """Grouped bars, one colour per series, each bar's value written up the bar (or across it
    when every value fits its width); the legend to the right of the axes."""
    n = max(1, len(series))
    width = 0.8 / n
    bars_per_row = len(groups) * n
    for k, s in enumerate(series):
        xs = [g + (k - (n - 1) / 2) * width for g in range(len(groups))]
        vals = [cells.get((gname, s)) for gname in groups]
        keep = [(x, v) for x, v in zip(xs, vals) if v is not None]
        if not keep:
            continue
        rects = ax.bar([x for x, _ in keep], [v for _, v in keep], width * 0.92,
                       color=COLORS[k % len(COLORS)], label=s, zorder=2)
        # Few bars are wide enough for their value written across; many are narrow: upright.
        # A white box under each value keeps the reference line from striking through it.
        ax.bar_label(rects, labels=[fmt(v) for _, v in keep], padding=2, fontsize=7.5,
                     rotation=0 if bars_per_row <= 24 else 90, zorder=3,
                     bbox=dict(facecolor="white", edgecolor="none", pad=0.5))
    if reference is not None:
        ax.axhline(reference, color="#555555", linewidth=0.8, linestyle="--", zorder=1)
    ax.set_title(title)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10]))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt(v)))
    ax.grid(axis="y", color="#dddddd", linewidth=0.6, zorder=0)
    ax.set_axisbelow(True)
    # Room above the tallest bar for its upright value.
    top = max(cells.values()) if cells else 1
    ax.set_ylim(0, top * (1.22 if bars_per_row > 24 else 1.12))
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_xlim(-0.5, len(groups) - 0.5)
    ax.tick_params(axis="x", length=0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8.5)


def fit_group_labels(fig, axes):
    """Values across their bars only where none touch (else upright); group labels on one line
    if they fit, else wrapped at spaces, else slanted 30 degrees."""
    renderer = fig.canvas.get_renderer()
    for ax in axes:
        values = sorted((t for t in ax.texts if t.get_rotation() == 0),
                        key=lambda t: t.get_window_extent(renderer).x0)
        if overlapping(values, renderer, gap_px=6):
            for t in values:
                t.set_rotation(90)
            top = ax.get_ylim()[1]
            ax.set_ylim(0, top * 1.1)
            fig.canvas.draw()
        labels = ax.get_xticklabels()
        if not overlapping(labels, renderer):
            continue
        texts = [t.get_text() for t in labels]
        width = max(len(t) for t in texts)
        for w in range(width - 1, 3, -1):
            ax.set_xticklabels([textwrap.fill(t, w) for t in texts])
            fig.canvas.draw()
            if not overlapping(ax.get_xticklabels(), renderer):
                break
        lines = max(t.get_text().count("\n") + 1 for t in ax.get_xticklabels())
        if overlapping(ax.get_xticklabels(), renderer) or lines > 2:
            ax.set_xticklabels(texts, rotation=30, ha="right", rotation_mode="anchor")
        fig.canvas.draw()


def draw(path, title, panels):
    fig, axes = plt.subplots(len(panels), 1, figsize=(WIDTH_IN, PANEL_IN * len(panels) + 0.5),
                             squeeze=False)
    axes = [a[0] for a in axes]
    for ax, panel in zip(axes, panels):
        bar_panel(ax, *panel)
    fig.suptitle(title, x=0.01, ha="left", fontsize=13)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.canvas.draw()
    fit_group_labels(fig, axes)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)


def table_panels(rows, group_of, series_of):
    """Measured tokens/s, then measured over predicted step time (1 = the planner exactly)."""
    panels = [("Measured tokens/s",
               *grid(rows, group_of, series_of, lambda r: r["tokens_per_s"]))]
    panels.append((
        "Measured / predicted step time (1 = the planner's prediction from profiled pass costs)",
        *grid(rows, group_of, series_of, lambda r: r["step_s"] / r["predicted_step_s"]), 1.0))
    return panels


def p_of(r):
    return "p=%d" % r["p"]


def vocab_group(r):
    return "%s V=%dk" % (p_of(r), r["V"] // 1024)


def main(argv):
    if len(argv) != 3:
        sys.stderr.write("usage: paper_charts.py RESULTS.json IMG_DIR\n")
        return 2
    try:
        with open(argv[1]) as f:
            doc = json.load(f)
        rows_all = doc["rows"]
        if not isinstance(rows_all, list):
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError):
        sys.stderr.write(f"paper_charts: {argv[1]}: not a paper_bench.py results file\n")
        return 2
    img = argv[2]
    tables = {}
    for r in rows_all:
        tables.setdefault(r["table"], []).append(r)
    for name in sorted(tables):
        rows = tables[name]
        by_vocab = name in ("vocab", "flat")
        if by_vocab:
            title = ("Vocabulary methods on 1F1B as V grows (real workers)" if name == "vocab" else
                     "Vocabulary methods as V grows at m = 16p microbatches (real workers)")
            panels = table_panels(rows, vocab_group, lambda r: r["vocab"])
            # Model GFLOP/s against the method's own V = 32k row: 1.0 is the paper's flat MFU.
            base = smallest_vocab_rate(rows)

            def relative(r, base=base):
                b = base.get((r["p"], r["vocab"]))
                return None if b is None else r["model_gflops_per_s"] / b
            rel = grid(rows, vocab_group, lambda r: r["vocab"], relative)
            if rel[0]:
                panels.append(("Model FLOP/s relative to the method's V = 32k row (MFU trend)",
                               *rel, 1.0))
        elif name == "vshape":
            title = "V-Half / V-Min against 1F1B (real workers)"
            panels = table_panels(rows, lambda r: "%s %s" % (p_of(r), r["vocab"]),
                                  lambda r: r["schedule"])
        else:
            title = "Seq1F1B at a long sequence against 1F1B (real workers)"

            def label(r):
                return "1f1b" if r["schedule"] == "1f1b" else "seq1f1b k=%d" % r["k"]
            panels = table_panels(rows, p_of, label)
            # Activation memory: grouped as the charts above (one bar per schedule).
            panels.append(("Peak activation memory (MiB, max over ranks)",
                           *grid(rows, p_of, label, lambda r: r["activation_mib_max"])))
        path = f"{img}/paper_{name}.svg"
        draw(path, title, panels)
        print(f"\n{title} ({path})\n\n{TABLE_HEAD}")
        base = smallest_vocab_rate(rows) if by_vocab else {}
        for r in rows:
            print(table_row(r, base))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
