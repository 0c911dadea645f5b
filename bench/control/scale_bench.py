#!/usr/bin/env python3
"""The coordinator at scale (issue 36): a real vocabpipe-coordinator over TLS, with N simulated
worker daemons (scale_bench: threads of one process, one TLS connection each) that register,
heartbeat every second and, in a job of N ranks, report one step a second. Per N: the
coordinator's CPU per wall second and resident memory, heartbeat and report latency (p50,
p99), its SQLite file's bytes per merged step, and the Prometheus series count and scrape time.

usage: scale_bench.py --build BUILD [--workers 64,256,1024] [--seconds 20] [--workdir DIR]
                      [--perf]

--perf: run the coordinator under `perf record -g` (WORKDIR/perf-N.data, for `perf report`);
its CPU figures are then perf's process's, so use it to find where the time goes, not to measure.

Everything runs on this machine: the simulated workers share its cores with the coordinator.
Prints a markdown table.
"""
import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request

from bench_control import pki, run, start_coordinator, synth_data, wait_line


def scrape(port):
    t0 = time.time()
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    ms = 1000 * (time.time() - t0)
    series = sum(1 for line in body.splitlines() if line and not line.startswith("#"))
    return series, ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--workers", default="64,256,1024")
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--perf", action="store_true")
    a = ap.parse_args()
    a.build = os.path.abspath(a.build)  # the coordinator and the bench run in the work folder
    vocabpipe = os.path.join(a.build, "client", "vocabpipe")
    coordinator = os.path.join(a.build, "coordinator", "server", "vocabpipe-coordinator")
    bench = os.path.join(a.build, "bench", "control", "scale_bench")
    work = os.path.abspath(a.workdir or tempfile.mkdtemp(prefix="vp_scale_bench_"))
    os.makedirs(work, exist_ok=True)
    certs, token = pki(vocabpipe, work)
    data = synth_data(vocabpipe, work)
    rows = []
    for n in [int(x) for x in a.workers.split(",")]:
        db = os.path.join(work, f"jobs-{n}.db")
        log = os.path.join(work, f"coordinator-{n}.log")
        wrap = (["perf", "record", "-F", "499", "-g", "-o",
                 os.path.join(work, f"perf-{n}.data"), "--"] if a.perf else [])
        proc, address = start_coordinator(
            coordinator, work, certs, db, log, wrap=wrap,
            extra=["--heartbeat-interval", "1", "--heartbeat-timeout", "60",
                   "--max-worker-memory", "0", "--metrics-listen", "127.0.0.1:0"])
        try:
            metrics = wait_line(log, r"metrics on port (\d+)").group(1)
            result = json.loads(run([bench, "--coordinator", address, "--certs", certs,
                                     "--token", token, "--pid", str(proc.pid), "--workers", str(n),
                                     "--data", data, "--db", db, "--seconds", str(a.seconds)],
                                    cwd=work))
            series, scrape_ms = scrape(metrics)
        finally:
            proc.terminate()
            proc.wait()
        # Steps merged in the window: every rank reports one a second.
        steps = max(1, result["reports"] // n)
        result.update(series=series, scrape_ms=scrape_ms,
                      db_bytes_per_step=result["db_bytes_in_window"] / steps)
        rows.append(result)
        print(json.dumps(result), file=sys.stderr)
    print("| N workers (ranks) | d × p | coordinator CPU / s | RSS MiB | heartbeat p50 / p99 ms | "
          "report p50 / p99 ms | errors | SQLite bytes / step | Prometheus series | scrape ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workers']} ({r['ranks_running']}) | {r['data']} × {r['pipeline']} | "
              f"{r['coordinator_cpu_per_s']:.3f} | {r['coordinator_rss_bytes'] / 1048576:.0f} | "
              f"{r['heartbeat_p50_ms']:.2f} / {r['heartbeat_p99_ms']:.2f} | "
              f"{r['report_p50_ms']:.2f} / {r['report_p99_ms']:.2f} | {r['errors']} | "
              f"{r['db_bytes_per_step']:.0f} | {r['series']} | {r['scrape_ms']:.1f} |")


if __name__ == "__main__":
    main()
