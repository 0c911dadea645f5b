#!/usr/bin/env python3
"""The papers' tables on the real engine: `vocabpipe run --direct` launches (p worker processes
over Gloo on loopback, one BLAS thread per rank), each row beside the planner's prediction.

usage: paper_bench.py --vocabpipe BUILD/client/vocabpipe [--img docs/img]
         [--worker BUILD/worker/main/vocabpipe-worker] [--grid small|full] [--pipelines 2,4]
         [--steps 5] [--vocabs 32768,...] [--methods baseline,...] [--no-comm] [--workdir DIR]
         [--out results.json] [--tables vocab,vshape,seq]
         (--img: the charts and tables of paper_charts.py, drawn with Debian's python3-matplotlib)
       paper_bench.py --vocabpipe ... --repredict results.json --workdir DIR [--out new.json]
         (the rows of an earlier run timed again with the current cost model, from the plan.txt
         and metrics.jsonl the runs left in DIR and each row's own link profile)

Tables (docs/benchmarks.md, "The papers' tables on real workers"):
  vocab   Table 5 shape: V in {32k, 64k, 128k, 256k} x {baseline, redis, interlaced, vocab1,
          vocab2} on 1F1B (h = 256, L = 8: --hidden, --heads, --layers);
  vshape  {vhalf, vmin} x {baseline, vocab1, vocab2} against 1f1b x the same (V = 64k; at
          least 2p layers, since a V shape holds two layer groups per rank);
  seq     Seq1F1B k in {1, 2, 4} at a long sequence against 1F1B (vocab2; s = 1024, h = 128,
          L = 4: --long-seq, --long-hidden, --long-heads, --long-layers).
  flat    (opt-in, --tables flat) the vocabulary table for {baseline, vocab1, vocab2} at the
          paper's microbatch ratio m = 16p, --flat-steps 3: the MFU trend as V grows.
--grid small keeps V in {32k, 128k} for `vocab`, fewer rows elsewhere, and p = 2 unless
--pipelines names more. `--grid full --pipelines 2,4` took 20 minutes on an idle 2-core
machine here (docs/benchmarks.md, section 9).

Measured per row (steps after the first, the warm-up, averaged): step seconds, tokens/s, MFU
(against the run's own measured sgemm peak per rank), busy max/mean, peak memory per rank.
Predicted: the planner's simulation of the plan the run executed (its plan.txt, through
`vocabpipe plan --plan plan.txt --format json --costs ...`) with per-pass costs *profiled on
the run itself*: the seconds each rank's compute thread spent in F, BW, S, T, IF, IB and OPT
over the timed steps, divided by how many of those passes the plan gives it and by the number
of timed steps; and the communication the plan schedules (P2P, BCAST_X, C1, C2, IF_REDUCE,
IB_BCAST) from the link model `vocabpipe-worker --profile-comm p` measures between p Gloo
ranks on this host at the job's two sizes (b·s and b·s·h floats): latency and bandwidth of a
send/recv, a broadcast and an all-reduce (--no-comm leaves communication out, comm=0).
"""
import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def charts(results, img):
    """paper_charts.py's charts into img and its markdown tables, by an interpreter that has
    matplotlib (Debian's python3-matplotlib is /usr/bin/python3's, whichever python3 runs this)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paper_charts.py")
    python = sys.executable
    if subprocess.run([python, "-c", "import matplotlib"], capture_output=True).returncode != 0:
        python = "/usr/bin/python3"
    return run([python, script, results, img])


def run(cmd):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}")
    return r.stdout


def grid(a):
    small = a.grid == "small"
    # --pipelines given: those; else the full grid runs p = 2 and 4, the small one p = 2.
    ps = [int(p) for p in (a.pipelines or ("2" if small else "2,4")).split(",")]
    methods = a.methods.split(",") if a.methods else []
    keep = lambda m: not methods or m in methods
    rows = []  # (table, p, schedule, vocab, V, seq, k, layers, hidden, heads, m, steps)
    big = (a.hidden, a.heads, a.microbatches, a.steps)  # the vocabulary and V-shape tables
    long = (a.long_hidden, a.long_heads, a.microbatches, a.steps)  # Seq1F1B (s = --long-seq)
    all_vs = [32768, 65536, 131072, 262144]

    def vocab_table(table, vs, methods, microbatches, steps):
        vs = [int(v) for v in a.vocabs.split(",")] if a.vocabs else vs
        for p in ps:
            for v in vs:
                for meth in methods:
                    if keep(meth):
                        rows.append((table, p, "1f1b", meth, v, a.seq, 1, a.layers, a.hidden,
                                     a.heads, microbatches(p), steps))

    if "vocab" in a.tables:
        vocab_table("vocab", [32768, 131072] if small else all_vs,
                    ["baseline", "redis", "interlaced", "vocab1", "vocab2"],
                    lambda p: a.microbatches, a.steps)
    if "flat" in a.tables:
        # The vocabulary table at the paper's microbatch ratio, m = 16p (its 8-GPU runs: 128
        # microbatches), where the 1F1B bubble is 1/17 of the transformer work or less: the MFU
        # trend as V grows without the bubble's shrinking share in it. Opt-in (p = 2: 316 s
        # here, p = 4: 577 s; docs/benchmarks.md): not part of the default tables.
        vocab_table("flat", all_vs, ["baseline", "vocab1", "vocab2"], lambda p: 16 * p,
                    a.flat_steps)
    if "vshape" in a.tables:
        for p in ps:
            # Two layer groups per rank: L must divide by 2p (the whole table uses that L).
            layers = a.layers if a.layers % (2 * p) == 0 else 2 * p * -(-a.layers // (2 * p))
            for sched in ["1f1b", "vhalf"] + ([] if small else ["vmin"]):
                for meth in ["baseline", "vocab1", "vocab2"]:
                    if keep(meth):
                        rows.append(("vshape", p, sched, meth, 65536, a.seq, 1, layers, *big))
    if "seq" in a.tables:
        for p in ps:
            rows.append(("seq", p, "1f1b", "vocab2", 32768, a.long_seq, 1, a.long_layers, *long))
            for k in [1, 2, 4]:
                rows.append(
                    ("seq", p, "seq1f1b", "vocab2", 32768, a.long_seq, k, a.long_layers, *long))
    # Every table at p = 2 first: a run cut short still has whole tables at the smaller p.
    return sorted(rows, key=lambda r: r[1])


def mean_busy(steps, p):
    """Per rank, each pass kind's busy seconds averaged over the timed steps."""
    busy = [collections.defaultdict(float) for _ in range(p)]
    for line in steps:
        for r, st in enumerate(line["stages"]):
            for kind, secs in st["busy"].items():
                busy[r][kind] += secs / len(steps)
    return busy


def comm_costs(a, p, tokens, hidden, cache):
    """The link model between p ranks on this host at the job's sizes (b·s, b·s·h floats), as
    --costs items; measured once per (p, sizes) and kept in `cache`."""
    key = (p, tokens, hidden)
    if key not in cache:
        prof = json.loads(run([a.worker, "--profile-comm", str(p), "--floats",
                               f"{tokens},{tokens * hidden}"]))
        cache[key] = prof
    prof = cache[key]
    return link_items(prof), prof


def link_items(prof):
    """A --profile-comm result as --costs items (none for no profile: comm=0)."""
    items = {}
    for kind, name in (("p2p", "p2p"), ("broadcast", "bcast"), ("allreduce", "ar")):
        if prof:
            items[f"{name}_lat"] = prof[kind]["latency"]
            items[f"{name}_bw"] = prof[kind]["bandwidth"]
    return items


def row_name(table, p, sched, k, method, vocab, seq, layers, hidden):
    return f"{table}_p{p}_{sched}_k{k}_{method}_V{vocab}_s{seq}_L{layers}_h{hidden}"


def predict(a, spec, plan_txt, steps, p, layers, comm):
    """The plan the ranks executed (plan_txt), timed by the planner's simulator with what they
    measured (the busy seconds per pass of the timed steps) and the link model `comm`: the
    row's predicted fields."""
    plan = json.loads(run([a.vocabpipe, "plan", spec, "--plan", plan_txt, "--format", "json"]))
    costs = profiled_costs(plan, mean_busy(steps, p), layers, p, comm)
    pred = json.loads(run([a.vocabpipe, "plan", spec, "--plan", plan_txt, "--format", "json",
                           "--costs", costs]))
    busy_pred = [r["busy"] for r in pred["ranks"]]
    return plan, {
        "predicted_step_s": pred["step_time"],
        "predicted_busy_max_over_mean": max(busy_pred) / statistics.mean(busy_pred),
        "predicted_peak_mib_per_rank": [
            (r["state_bytes"] + r["peak_activation_bytes"]) / 2**20 for r in plan["ranks"]],
        "costs": costs,
        "predicted_comm_s_per_rank": [r.get("comm", 0) for r in pred["ranks"]],
    }


def read_steps(work, name):
    with open(os.path.join(work, name, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f][1:]
    if not steps:
        sys.exit("need --steps >= 2 (the first step is warm-up)")
    return steps


def repredict(a):
    """--repredict: the rows of an earlier results file timed again with this file's cost
    conversion and the link profile each row was measured with; the runs' plan.txt and
    metrics.jsonl must still be in --workdir."""
    with open(a.repredict) as f:
        doc = json.load(f)
    for row in doc["rows"]:
        name = row_name(row["table"], row["p"], row["schedule"], row["k"], row["vocab"],
                        row["V"], row["seq"], row["layers"], row["hidden"])
        spec = os.path.join(a.workdir, name + ".yaml")
        _, fields = predict(a, spec, os.path.join(a.workdir, name, "plan.txt"),
                            read_steps(a.workdir, name), row["p"], row["layers"],
                            link_items(row.get("comm_profile")))
        before = row["gap"]
        row.update(fields)
        row["gap"] = row["predicted_step_s"] / row["step_s"] - 1
        print(f"{name}: {row['step_s']:.3f} s/step, predicted {row['predicted_step_s']:.3f} s "
              f"({100 * row['gap']:+.0f}%, was {100 * before:+.0f}%)", flush=True)
    out = a.out or a.repredict
    with open(out + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(out + ".tmp", out)
    return out


def profiled_costs(plan, busy, layers, p, comm):
    """Per-pass seconds from the measured busy time per pass (mean over the timed steps) and
    the plan's actions, plus the communication link model `comm` (--costs items)."""
    count = [collections.Counter(re.match(r"[A-Z_]+", x).group(0) for x in r["actions"])
             for r in plan["ranks"]]
    per = collections.defaultdict(list)
    f_layers = []
    for r, st in enumerate(busy):
        for kind, secs in st.items():
            n = count[r].get(kind, 0)
            if n == 0:
                continue
            if kind in ("F", "BW", "B", "W"):
                # The planner's F/B/W cost is one whole microbatch through L/p layers. A rank
                # runs each microbatch through its nl layers in m_actions / m actions: one
                # (1F1B), two half-stages (V shapes) or k sequence chunks (Seq1F1B).
                nl = plan["ranks"][r]["layers"]
                if nl:
                    f_layers.append((kind, secs / plan["microbatches"] / nl * (layers / p)))
            elif kind == "OPT":
                per["opt"].append(secs)
            else:
                per[kind].append(secs / n)
    costs = {}
    for kind in ("F", "BW", "B", "W"):
        v = [s for k, s in f_layers if k == kind]
        if v:
            costs[kind] = statistics.mean(v)
    # Fused BW (1F1B) or split B and W (V-shapes, zero-bubble schedules).
    if "BW" in costs:
        c = {"F": costs.get("F", 0), "B": costs["BW"], "W": 0}
    else:
        c = {"F": costs.get("F", 0), "B": costs.get("B", 0), "W": costs.get("W", 0)}
    # The unsharded output layer (baseline, redis) is one S/T action costing p*S, p*T.
    full = plan["vocab"] in ("baseline", "redis")
    for kind in ("S", "T"):
        if per[kind]:
            c[kind] = max(per[kind]) / (p if full else 1)
    for kind, key in (("IF", "IF"), ("IB", "IB")):
        if per[kind]:
            c[key] = max(per[kind])
    if per["opt"]:
        c["opt"] = max(per["opt"])
    # Seq1F1B: every S/T/IF/IB pass is one sequence chunk; the planner's costs are per whole
    # microbatch (a chunk costs its share, chunks have equal FLOPs by construction). F/B/W are
    # per whole microbatch already (above).
    k = plan.get("seq_chunks", 1)
    for key in ("S", "T", "IF", "IB"):
        if key in c:
            c[key] *= k
    c["comm"] = 0
    c["coll"] = 0
    c.update(comm)
    return ",".join(f"{k}={v:.9g}" for k, v in c.items())


def save(a, work, t0, results):
    out = a.out or os.path.join(work, "results.json")
    with open(out + ".tmp", "w") as f:
        json.dump({"grid": a.grid, "wall_s": time.time() - t0, "rows": results}, f, indent=1)
    os.replace(out + ".tmp", out)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocabpipe", required=True)
    ap.add_argument("--grid", choices=["small", "full"], default="full")
    ap.add_argument("--pipelines", default="")
    ap.add_argument("--tables", default="vocab,vshape,seq")
    # The vocabulary and V-shape tables: h = 256 and L = 8, so the transformer layers are a
    # real share of the work at V = 32k (45%) and the kernels run near their sgemm rate.
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    # The Seq1F1B table: a long sequence on a smaller model (s = 1024 at h = 256, L = 8 would
    # take ~15 s per step here).
    ap.add_argument("--long-seq", type=int, default=1024)
    ap.add_argument("--long-layers", type=int, default=4)
    ap.add_argument("--long-hidden", type=int, default=128)
    ap.add_argument("--long-heads", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--flat-steps", type=int, default=3)
    ap.add_argument("--worker", default="")
    ap.add_argument("--vocabs", default="")
    ap.add_argument("--methods", default="")
    ap.add_argument("--no-comm", action="store_true")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--img", default="")
    ap.add_argument("--repredict", default="")
    a = ap.parse_args()
    if not a.worker:
        a.worker = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(a.vocabpipe))),
                                "worker", "main", "vocabpipe-worker")

    if a.repredict:
        if not a.workdir:
            sys.exit("--repredict needs the --workdir the rows ran in")
        out = repredict(a)
        if a.img:
            print(charts(out, a.img), end="")
        return
    work = a.workdir or tempfile.mkdtemp(prefix="vp_paper_bench_")
    os.makedirs(work, exist_ok=True)
    results = []
    t0 = time.time()
    datas = {}
    comm_cache = {}
    rows = grid(a)
    # Enough tokens for every row's steps plus one (b = 1), twice over, and at least 100k.
    tokens = max([100000] + [seq * m * (nsteps + 1) * 2 for (*_, seq, _, _, _, _, m, nsteps)
                             in rows])
    for (table, p, sched, method, vocab, seq, k, layers, hidden, heads, m, nsteps) in rows:
        if vocab not in datas:
            datas[vocab] = os.path.join(work, f"data_{vocab}.bin")
            run([a.vocabpipe, "data", "synth", "--vocab", str(vocab), "--tokens", str(tokens),
                 "--out", datas[vocab], "--seed", "1"])
        name = row_name(table, p, sched, k, method, vocab, seq, layers, hidden)
        spec = os.path.join(work, name + ".yaml")
        with open(spec, "w") as f:
            f.write(
                f"model: {{layers: {layers}, hidden: {hidden}, heads: {heads}, "
                f"vocab_size: {vocab}, seq_len: {seq}}}\n"
                f"parallel: {{pipeline: {p}, schedule: {sched}, vocab: {method}, "
                f"microbatches: {m}" + (f", seq_chunks: {k}" if sched.startswith("seq") else "")
                + "}\n"
                f"train: {{steps: {nsteps}, threads: 1}}\n"
                f"data: {{path: {datas[vocab]}}}\n"
                f"checkpoint: {{dir: {os.path.join(work, name)}, every: 1000000}}\n")
        start = time.time()
        run([a.vocabpipe, "run", spec, "--direct", "--timeout", "600"])
        steps = read_steps(work, name)
        # The final checkpoint is not measured and would fill the disk (at V = 256k, h = 256 a
        # row's weights and AdamW moments are ~1.5 GB): keep the run's logs and plan only.
        for entry in os.listdir(os.path.join(work, name)):
            if entry.startswith("step_"):
                shutil.rmtree(os.path.join(work, name, entry))
        comm, prof = ({}, None) if a.no_comm else comm_costs(a, p, seq, hidden, comm_cache)
        plan, predicted = predict(a, spec, os.path.join(work, name, "plan.txt"), steps, p, layers,
                                  comm)
        # Measured per rank: the compute thread's step = busy + waiting + the rest (batch
        # assembly, zeroing gradients, bookkeeping between passes), and the communication
        # thread's seconds (transfers and collectives, including waiting for peers).
        ranks_measured = [{
            "seconds": statistics.mean(s["stages"][r]["seconds"] for s in steps),
            "busy": statistics.mean(s["stages"][r]["busy_seconds"] for s in steps),
            "compute_wait": statistics.mean(s["stages"][r]["compute_wait_seconds"] for s in steps),
            "comm": statistics.mean(s["stages"][r]["comm_seconds"] for s in steps),
        } for r in range(p)]
        row = {
            "table": table, "p": p, "schedule": sched, "vocab": method, "V": vocab, "seq": seq,
            "k": k, "m": m, "layers": layers, "hidden": hidden, "timed_steps": len(steps),
            "step_s_each": [s["step_seconds"] for s in steps],
            "step_s": statistics.mean(s["step_seconds"] for s in steps),
            "tokens_per_s": statistics.mean(s["tokens_per_s"] for s in steps),
            "mfu": statistics.mean(s["mfu"] for s in steps),
            # Model FLOPs per second (the plan's model FLOPs per step over the measured step):
            # MFU against one fixed peak, so rows compare without each run's own peak
            # measurement in the ratio (the paper's "consistent MFU as V grows").
            "model_gflops_per_s": plan["model_flops"] / 1e9 / statistics.mean(
                s["step_seconds"] for s in steps),
            "busy_max_over_mean": statistics.mean(s["busy_max_over_mean"] for s in steps),
            "peak_mib_per_rank": [max(s["stages"][r]["memory"]["total"] for s in steps) / 2**20
                                  for r in range(p)],
            "activation_mib_max": max(
                max(s["stages"][r]["memory"].get("activations", 0) for s in steps)
                for r in range(p)) / 2**20,
            **predicted,
            "measured_per_rank": ranks_measured,
            "comm_profile": prof,
            "wall_s": time.time() - start,
        }
        row["gap"] = row["predicted_step_s"] / row["step_s"] - 1
        # Pipeline efficiency: the share of the step the ranks' compute threads were busy.
        row["busy_share"] = statistics.mean(m["busy"] for m in ranks_measured) / row["step_s"]
        results.append(row)
        save(a, work, t0, results)  # after every row, so a cut-short run keeps what it measured
        spread = (max(row["step_s_each"]) - min(row["step_s_each"])) / row["step_s"]
        print(f"{name}: {row['step_s']:.3f} s/step ({row['tokens_per_s']:.0f} tok/s, "
              f"steps spread {100 * spread:.0f}%), "
              f"predicted {row['predicted_step_s']:.3f} s ({100 * row['gap']:+.0f}%, comm "
              f"{max(row['predicted_comm_s_per_rank']):.3f} s), "
              f"{row['wall_s']:.0f} s wall", flush=True)
    out = save(a, work, t0, results)
    print(f"results: {out} ({time.time() - t0:.0f} s)")
    if a.img:
        print(charts(out, a.img), end="")


if __name__ == "__main__":
    main()
