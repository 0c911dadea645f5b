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
import re
import subprocess
import sys
import tempfile
import time
import urllib.request


def run(cmd, **kw):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}")
    return r.stdout


def wait_line(path, pattern, seconds=30):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if os.path.exists(path):
            m = re.search(pattern, open(path).read())
            if m:
                return m
        time.sleep(0.1)
    sys.exit(f"no '{pattern}' in {path}:\n" + (open(path).read() if os.path.exists(path) else ""))


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
    work = a.workdir or tempfile.mkdtemp(prefix="vp_scale_bench_")
    os.makedirs(work, exist_ok=True)
    certs = os.path.join(work, "certs")
    if not os.path.exists(os.path.join(certs, "ca.pem")):
        run([vocabpipe, "certs", "init", certs])
    tokens = os.path.join(work, "tokens")
    token = run([vocabpipe, "certs", "token", "bench", "--tokens", tokens]).strip().split()[-1]
    data = os.path.join(work, "data.bin")
    if not os.path.exists(data):
        run([vocabpipe, "data", "synth", "--vocab", "64", "--tokens", "100000", "--out", data,
             "--seed", "1"])
    rows = []
    for n in [int(x) for x in a.workers.split(",")]:
        db = os.path.join(work, f"jobs-{n}.db")
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(db + suffix):
                os.remove(db + suffix)
        log = os.path.join(work, f"coordinator-{n}.log")
        with open(log, "w") as out:
            wrap = (["perf", "record", "-F", "499", "-g", "-o",
                     os.path.join(work, f"perf-{n}.data"), "--"] if a.perf else [])
            proc = subprocess.Popen(
                wrap + [coordinator, "--listen", "127.0.0.1:0", "--db", db,
                 "--tls-cert", os.path.join(certs, "server.pem"),
                 "--tls-key", os.path.join(certs, "server-key.pem"),
                 "--tls-ca", os.path.join(certs, "ca.pem"), "--tokens", tokens,
                 "--no-profile", "--heartbeat-interval", "1", "--heartbeat-timeout", "60",
                 "--max-worker-memory", "0", "--metrics-listen", "127.0.0.1:0",
                 "--storage-root", work],
                stdout=out, stderr=subprocess.STDOUT, cwd=work)
        try:
            port = wait_line(log, r"listening on [^\s:]+:(\d+)").group(1)
            metrics = wait_line(log, r"metrics on port (\d+)").group(1)
            result = json.loads(run([bench, "--coordinator", f"127.0.0.1:{port}", "--certs", certs,
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
