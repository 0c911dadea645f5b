#!/usr/bin/env python3
"""Rendezvous at scale (issue 36): how long N real ranks take from RUNNING to their first step.

A real vocabpipe-coordinator over TLS and N real vocabpipe-worker daemons (one worker
certificate for all) on this machine; one job of N ranks (d = N/p replicas of a p-stage
pipeline of a tiny GPT-2, threads 1) that runs a few steps. Per N, from the job's events and its
ranks' logs:

  - RUNNING → step 1 merged: the coordinator's view (the RunTask goes out with each daemon's
    next heartbeat, the rank process starts, connects its groups through the coordinator's
    rendezvous store, runs step 1; its line reaches the coordinator in the daemon's next metrics
    batch of 0.5 s);
  - each rank's "connected in X s" (its rendezvous: every Gloo group it joins), the slowest and
    the median;
  - when each rank's RunTask arrived (its daemon writes plan_rank_R.txt), after RUNNING;
  - the coordinator's CPU seconds from submit to the job's end (its store serves every key),
    and how busy the machine's cores were over that time.

usage: rendezvous_bench.py --build BUILD [--ranks 16,64] [--pipeline 4] [--workdir DIR]

Prints a markdown table. The ranks share the machine's cores with each other and the daemons.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench_control import pki, run, start_coordinator, synth_data


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy():
    """(busy, total) jiffies of every core since boot (/proc/stat)."""
    values = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--pipeline", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--workdir", default="")
    a = ap.parse_args()
    build = os.path.abspath(a.build)
    vocabpipe = os.path.join(build, "client", "vocabpipe")
    coordinator = os.path.join(build, "coordinator", "server", "vocabpipe-coordinator")
    worker = os.path.join(build, "worker", "main", "vocabpipe-worker")
    work = os.path.abspath(a.workdir or tempfile.mkdtemp(prefix="vp_rendezvous_bench_"))
    os.makedirs(work, exist_ok=True)
    certs, token = pki(vocabpipe, work, worker_names=["bench-worker"])
    data = synth_data(vocabpipe, work)
    rows = []
    for n in [int(x) for x in a.ranks.split(",")]:
        p = a.pipeline
        d = n // p
        db = os.path.join(work, f"jobs-{n}.db")
        log = os.path.join(work, f"coordinator-{n}.log")
        daemons = []
        proc, address = start_coordinator(coordinator, work, certs, db, log,
                                          extra=["--rank-timeout", "300"])
        try:
            env = dict(os.environ, VOCABPIPE_TOKEN=token)
            cli = ["--coordinator", address, "--tls-ca", os.path.join(certs, "ca.pem")]
            for i in range(n):
                daemons.append(subprocess.Popen(
                    [worker, "--coordinator", address, "--tls-ca", os.path.join(certs, "ca.pem"),
                     "--tls-cert", os.path.join(certs, "bench-worker.pem"),
                     "--tls-key", os.path.join(certs, "bench-worker-key.pem"),
                     "--storage-root", work],
                    stdout=open(os.path.join(work, f"daemon-{n}-{i}.log"), "w"),
                    stderr=subprocess.STDOUT, cwd=work))
            deadline = time.time() + 120
            while True:
                listed = json.loads(run([vocabpipe, "workers", "--output", "json"] + cli, env=env))
                workers = listed.get("workers", listed) if isinstance(listed, dict) else listed
                if len(workers) >= n:
                    break
                if time.time() > deadline:
                    sys.exit(f"only {len(workers)} of {n} daemons registered")
                time.sleep(0.5)
            name = f"rdv{n}"
            shutil.rmtree(os.path.join(work, name), ignore_errors=True)  # a fresh run folder
            spec = os.path.join(work, f"{name}.yaml")
            with open(spec, "w") as f:
                f.write(f"name: {name}\n"
                        "model: {layers: 4, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16}\n"
                        f"parallel: {{pipeline: {p}, data: {d}, microbatch_size: 1, "
                        "microbatches: 4}\n"
                        f"train: {{steps: {a.steps}, threads: 1}}\n"
                        f"data: {{path: {data}}}\ncheckpoint: {{dir: {os.path.join(work, name)}}}\n")
            cpu0 = cpu_seconds(proc.pid)
            busy0 = machine_busy()
            job = run([vocabpipe, "submit", spec] + cli, env=env).strip().split()[-1]
            deadline = time.time() + 600
            while True:
                status = json.loads(run([vocabpipe, "status", job, "--output", "json"] + cli,
                                        env=env))
                state = status.get("state", "")
                if state in ("SUCCEEDED", "FAILED", "CANCELLED", "JOB_STATE_SUCCEEDED",
                             "JOB_STATE_FAILED", "JOB_STATE_CANCELLED"):
                    break
                if time.time() > deadline:
                    sys.exit(f"job {job} still {state} after 600 s")
                time.sleep(1)
            cpu = cpu_seconds(proc.pid) - cpu0
            busy1 = machine_busy()
            if "SUCCEEDED" not in state:
                sys.exit(f"job {job}: {state}: {status.get('reason', '')}")
            events = [json.loads(line) for line in run(
                [vocabpipe, "watch", job, "--output", "json"] + cli, env=env).splitlines()
                if line.startswith("{")]
        finally:
            for dmn in daemons:
                dmn.terminate()
            for dmn in daemons:
                dmn.wait()
            proc.terminate()
            proc.wait()
        running = next(e for e in events if "RUNNING" in str(e.get("state", ""))
                       and "step" not in e)
        first = next(e for e in events if "step" in e and int(e["step"].get("step", 0)) == 1)
        span = (int(first["unix_ms"]) - int(running["unix_ms"])) / 1000
        connected, arrived = [], []
        run_dir = os.path.join(work, name)
        for f in os.listdir(run_dir):
            if f.startswith("plan_rank_"):  # written by the daemon when its RunTask arrives
                arrived.append(os.stat(os.path.join(run_dir, f)).st_mtime -
                               int(running["unix_ms"]) / 1000)
            if f.endswith(".log"):
                m = re.search(r"connected in ([0-9.]+) s", open(os.path.join(run_dir, f)).read())
                if m:
                    connected.append(float(m.group(1)))
        rows.append(dict(ranks=n, d=d, p=p, running_to_step1_s=span, ranks_logged=len(connected),
                         task_arrival_median_s=statistics.median(arrived),
                         task_arrival_max_s=max(arrived),
                         machine_busy=(busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]),
                         connect_median_s=statistics.median(connected) if connected else -1,
                         connect_max_s=max(connected) if connected else -1,
                         coordinator_cpu_s=cpu))
        print(json.dumps(rows[-1]), file=sys.stderr)
    print("| ranks | d × p | RUNNING → step 1 merged s | RunTask arrival median / max s | "
          "rank connect median / max s | coordinator CPU s | machine busy |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['d']} × {r['p']} | {r['running_to_step1_s']:.2f} | "
              f"{r['task_arrival_median_s']:.2f} / {r['task_arrival_max_s']:.2f} | "
              f"{r['connect_median_s']:.2f} / {r['connect_max_s']:.2f} | "
              f"{r['coordinator_cpu_s']:.2f} | {100 * r['machine_busy']:.0f}% |")


if __name__ == "__main__":
    main()
