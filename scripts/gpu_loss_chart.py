#!/usr/bin/env python3
"""Loss curves of a GPU run (run.sh's logs) against the CPU references, as one SVG.

usage: gpu_loss_chart.py RUNS REFS OUT.svg [--title TEXT]

RUNS: the runs/ folder of a run.sh log archive (gpu-p1-fp32, gpu-p1-bf16 and, when present,
gpu-p1-bf16-fma / gpu-p1-bf16-tc); REFS: the bundle's refs/ (gpu-p1-fp32-cpu). Left: the loss per
step of each run (200 steps) with the CPU's 20 reference steps; right: |cuda - cpu| / cpu per step
for the fp32 jobs that have a CPU reference (log scale), with the 1e-4 acceptance limit.
Standard library only.
"""

import argparse
import json
import math
import os

W, H, PAD = 460, 300, 50
COLORS = {"gpu-p1-fp32": "#1f77b4", "gpu-p1-bf16": "#d62728", "gpu-p1-bf16-fma": "#ff7f0e",
          "gpu-p1-bf16-tc": "#ff7f0e", "cpu": "#000000", "gpu-p2-vocab1": "#2ca02c",
          "gpu-p2-vocab2": "#9467bd", "gpu-llama-p2": "#8c564b"}


def load(folder, name):
    path = os.path.join(folder, name, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        lines = [json.loads(l) for l in f if l.strip()]
    return sorted(lines, key=lambda l: l["step"])


def polyline(points, color, dash=""):
    pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    extra = f' stroke-dasharray="{dash}"' if dash else ""
    return f'<polyline fill="none" stroke="{color}" stroke-width="1.5"{extra} points="{pts}"/>'


def xticks(x0, n, every):
    out = []
    for s in range(0, n, every):
        x = x0 + PAD + (W - 2 * PAD) * s / max(n - 1, 1)
        out.append(f'<text x="{x:.1f}" y="{H - PAD + 14}" text-anchor="middle" '
                   f'font-size="10">{s}</text>')
    return out


def axes(x0, title, xlabel, ylabel, yticks):
    out = [f'<rect x="{x0 + PAD}" y="{PAD}" width="{W - 2 * PAD}" height="{H - 2 * PAD}" '
           'fill="none" stroke="#888"/>',
           f'<text x="{x0 + W / 2}" y="{PAD - 18}" text-anchor="middle" font-size="13">{title}</text>',
           f'<text x="{x0 + W / 2}" y="{H - 12}" text-anchor="middle" font-size="11">{xlabel}</text>',
           f'<text x="{x0 + 14}" y="{H / 2}" font-size="11" transform="rotate(-90 {x0 + 14} '
           f'{H / 2})" text-anchor="middle">{ylabel}</text>']
    for y, label in yticks:
        out.append(f'<text x="{x0 + PAD - 4}" y="{y + 4:.1f}" text-anchor="end" '
                   f'font-size="10">{label}</text>')
        out.append(f'<line x1="{x0 + PAD}" x2="{x0 + W - PAD}" y1="{y:.1f}" y2="{y:.1f}" '
                   'stroke="#eee"/>')
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs")
    ap.add_argument("refs")
    ap.add_argument("out")
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    runs = {n: load(a.runs, n) for n in ["gpu-p1-fp32", "gpu-p1-bf16", "gpu-p1-bf16-fma",
                                         "gpu-p1-bf16-tc"]}
    runs = {n: r for n, r in runs.items() if r}
    cpu = load(a.refs, "gpu-p1-fp32-cpu")
    steps = max(len(r) for r in runs.values())
    lo = min(min(l["loss"] for l in r) for r in runs.values())
    hi = max(max(l["loss"] for l in r) for r in runs.values())
    sx = lambda s: PAD + (W - 2 * PAD) * s / max(steps - 1, 1)
    sy = lambda v: PAD + (H - 2 * PAD) * (hi - v) / (hi - lo)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{H + 20}" '
           'font-family="sans-serif">', '<rect width="100%" height="100%" fill="white"/>']
    ticks = [(sy(v), f"{v:.0f}") for v in range(math.ceil(lo), math.floor(hi) + 1)]
    svg += axes(0, "loss per step (p = 1, one H100)", "step", "loss", ticks)
    svg += xticks(0, steps, 50)
    legend = []
    for name, r in runs.items():
        svg.append(polyline([(sx(l["step"]), sy(l["loss"])) for l in r], COLORS[name]))
        legend.append((name.replace("gpu-p1-", "cuda "), COLORS[name], ""))
    if cpu:
        svg.append(polyline([(sx(l["step"]), sy(l["loss"])) for l in cpu], COLORS["cpu"], "4 3"))
        legend.append(("cpu fp32 (20 steps)", COLORS["cpu"], "4 3"))
    for i, (label, color, dash) in enumerate(legend):
        y = PAD + 14 + 16 * i
        svg.append(polyline([(W - PAD - 150, y), (W - PAD - 128, y)], color, dash))
        svg.append(f'<text x="{W - PAD - 124}" y="{y + 4}" font-size="11">{label}</text>')

    # Right: relative difference to the CPU per step (log scale, 1e-10 .. 1e-3).
    x0 = W
    dlo, dhi = -11, -3  # a step that matched exactly is drawn at 1e-11
    ry = lambda d: PAD + (H - 2 * PAD) * (dhi - math.log10(max(d, 10.0 ** dlo))) / (dhi - dlo)
    ticks = [(ry(10.0 ** e), f"1e{e}") for e in range(dlo, dhi + 1)]
    svg += axes(x0, "|cuda fp32 − cpu| / cpu per step", "step", "relative difference", ticks)
    svg += xticks(x0, 20, 5)
    svg.append(f'<line x1="{x0 + PAD}" x2="{x0 + W - PAD}" y1="{ry(1e-4):.1f}" y2="{ry(1e-4):.1f}" '
               'stroke="#d62728" stroke-dasharray="6 3"/>')
    svg.append(f'<text x="{x0 + W - PAD - 4}" y="{ry(1e-4) - 4:.1f}" text-anchor="end" '
               'font-size="10" fill="#d62728">acceptance limit 1e-4</text>')
    i = 0
    for name in ["gpu-p1-fp32", "gpu-p2-vocab1", "gpu-p2-vocab2", "gpu-llama-p2"]:
        got, want = load(a.runs, name), load(a.refs, name + "-cpu")
        if not got or not want:
            continue
        n = min(len(got), len(want))
        rx = lambda s: x0 + PAD + (W - 2 * PAD) * s / max(n - 1, 1)
        pts = [(rx(s), ry(abs(got[s]["loss"] - want[s]["loss"]) / abs(want[s]["loss"])))
               for s in range(n)]
        svg.append(polyline(pts, COLORS[name]))
        y = ry(10.0 ** -4.5) + 14 * i  # between the limit and the curves
        svg.append(polyline([(x0 + PAD + 8, y), (x0 + PAD + 30, y)], COLORS[name]))
        svg.append(f'<text x="{x0 + PAD + 34}" y="{y + 4}" font-size="11">{name}</text>')
        i += 1
    if a.title:
        svg.append(f'<text x="{W}" y="{H + 14}" text-anchor="middle" font-size="11">{a.title}</text>')
    svg.append("</svg>")
    with open(a.out, "w") as f:
        f.write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()
