#!/usr/bin/env python3
"""Coordinator restart soak (issue 29): a real vocabpipe-coordinator over TLS (certificates and
an admin token made by `vocabpipe certs`, a certificate of its own per worker daemon) and p
worker daemons on loopback. One job after another, each uninterrupted run's twin: at a random
step the coordinator is killed with SIGKILL and started again on the same database and address
(after --down seconds). The daemons must register again on their own, the coordinator must
re-adopt every rank, and the job must SUCCEED as the same attempt (no restart) with the final
weights of an uninterrupted run. The daemons live through every repetition, as in production.

usage: readopt_bench.py --bin BUILD [--n 10] [--pipeline 2] [--steps 60] [--every 5]
         [--down 0] [--seed 1] [--workdir DIR] [--insecure] [--timeout-per-job 120]

Per repetition: the step at the kill; the re-registration time, from the restarted
coordinator's first event ("coordinator restarted: waiting ...", written when it opens the
database) to the job's "re-adopted after the coordinator restart" event (every rank's daemon
registered again and holds its rank), both on the coordinator's clock; the time from the kill
to that event; the outcome. Prints a markdown table; exits 1 if any repetition did not succeed
as the same attempt with the uninterrupted run's weights, or took more than 30 s to re-adopt.
"""
import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import TERMINAL, Cluster as ClusterBase, prepare_workdir, sha256  # noqa: E402


class Cluster(ClusterBase):
    """The coordinator (restarted by kill()/start()) and the daemons, all this script's."""

    def __init__(self, a, work):
        super().__init__(a, work, ["--insecure"] if a.insecure else [])
        self.starts = 0
        certs = os.path.join(work, "certs")
        if not a.insecure:
            self.run_cli("certs", "init", certs)
            tokens = os.path.join(work, "tokens")
            token = self.run_cli("certs", "token", "bench", "--role", "admin", "--tokens", tokens)
            self.env["VOCABPIPE_TOKEN"] = token.strip().splitlines()[-1]
            self.env["VOCABPIPE_TLS_CA"] = os.path.join(certs, "ca.pem")
            # A TLS coordinator confines data.path and checkpoint.dir to its storage root.
            self.server_flags = ["--tls-cert", os.path.join(certs, "server.pem"),
                                 "--tls-key", os.path.join(certs, "server-key.pem"),
                                 "--tls-ca", os.path.join(certs, "ca.pem"), "--tokens", tokens,
                                 "--storage-root", work]
        else:
            self.server_flags = ["--insecure"]
        self.start()
        for k in range(a.pipeline):
            if a.insecure:
                flags = ["--insecure"]
            else:
                name = f"node{k}"
                self.run_cli("certs", "worker", name, certs)
                flags = ["--tls-ca", os.path.join(certs, "ca.pem"),
                         "--tls-cert", os.path.join(certs, f"{name}.pem"),
                         "--tls-key", os.path.join(certs, f"{name}-key.pem")]
            log = open(os.path.join(work, f"worker_{k}.log"), "w")
            self.daemons.append(subprocess.Popen(self.worker_args(*flags), stdout=log,
                                                 stderr=subprocess.STDOUT))
        self.wait_workers(a.pipeline)

    def start(self):
        """Starts the coordinator on the database and address; returns when it listens."""
        self.starts += 1
        log_path = os.path.join(self.work, f"coordinator_{self.starts}.log")
        self.coordinator = subprocess.Popen(self.coordinator_args(10, *self.server_flags),
                                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
        end = time.time() + 30
        while time.time() < end:
            with open(log_path) as f:
                if "listening on" in f.read():
                    return
            if self.coordinator.poll() is not None:
                break
            time.sleep(0.02)
        sys.exit(f"the coordinator did not start: see {log_path}")

    def kill(self):
        self.coordinator.send_signal(signal.SIGKILL)
        self.coordinator.wait()

    def events(self, job_id, limit=20):
        """The job's events; `watch` follows a job that is not over, so it is cut at `limit`."""
        p = subprocess.Popen([self.cli, "watch", job_id, "--output", "json",
                              *self.coordinator_flags()], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=self.env)
        try:
            out, _ = p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        events = []
        for line in out.splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:  # not an event, or cut short
                pass
        return events


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True, help="the build folder (BUILD/client/vocabpipe ...)")
    ap.add_argument("--n", type=int, default=10, help="coordinator kills (one per job)")
    ap.add_argument("--pipeline", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=5, help="checkpoint.every")
    ap.add_argument("--down", type=float, default=0.0,
                    help="seconds between the kill and the restart")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--insecure", action="store_true", help="plaintext (the old passing case)")
    ap.add_argument("--timeout-per-job", type=float, default=120)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    work = prepare_workdir(a, "vp_readopt_")
    started = time.time()
    cluster = Cluster(a, work)
    rows = []
    skipped = []  # jobs that ended before their kill
    try:
        _, ref_sha = cluster.reference()
        # A job that ends before its kill step is seen (the CLI polls about twice a second)
        # is not a repetition: jobs go on until n kills were made (at most 2n jobs).
        i = 0
        while sum(1 for r in rows if r["kill_step"] is not None) < a.n and i < 2 * a.n:
            name = f"restart{i}"
            i += 1
            target = rng.randint(2, a.steps // 2)  # kill after this many recorded steps
            job_id = cluster.submit(name)
            end = time.time() + a.timeout_per_job
            j = cluster.job(job_id)
            while time.time() < end and j["state"] not in TERMINAL and not (
                    j["state"] == "RUNNING" and j.get("step", 0) >= target):
                time.sleep(0.02)
                j = cluster.job(job_id)
            row = {"job": job_id, "kill_step": None, "rereg": None, "kill_to_adopted": None,
                   "state": j["state"], "restarts": None, "same_attempt": False,
                   "steps_once": False, "same_weights": False, "reason": ""}
            if j["state"] != "RUNNING":
                skipped.append(f"{job_id}: {j['state']} when its kill step {target} was due")
                print(skipped[-1], flush=True)
                continue
            row["kill_step"] = j.get("step", 0)
            cluster.kill()
            killed_at = time.time()
            time.sleep(a.down)
            cluster.start()
            j = cluster.wait_state(job_id, TERMINAL, max(1.0, end - time.time()))
            events = cluster.events(job_id)
            # The CLI's job record has no attempt: the events tell. A restart is a PENDING
            # event "restart N: attempt ..."; the attempt the restarted coordinator waits for
            # is named in its first event, and stays the job's unless a restart follows.
            restarted_ms = adopted_ms = None
            steps, restarts, waited_for = [], 0, None
            for e in events:
                msg = e.get("message", "")
                if "step" in e and isinstance(e["step"], dict):
                    steps.append(e["step"].get("step"))
                elif msg.startswith("coordinator restarted: waiting") and restarted_ms is None:
                    restarted_ms = e["unix_ms"]
                    waited_for = msg.split(" of attempt ")[-1].split(" ")[0]
                elif "re-adopted after the coordinator restart" in msg and adopted_ms is None:
                    adopted_ms = e["unix_ms"]
                elif e.get("state") == "PENDING" and msg.startswith("restart "):
                    restarts += 1
            if restarted_ms is not None and adopted_ms is not None:
                row["rereg"] = (adopted_ms - restarted_ms) / 1000.0
                row["kill_to_adopted"] = adopted_ms / 1000.0 - killed_at
            weights = cluster.weights(name)
            row.update({
                "state": j["state"], "restarts": restarts,
                "same_attempt": waited_for is not None and restarts == 0,
                "steps_once": steps == list(range(1, a.steps + 1)),
                "same_weights": os.path.exists(weights) and sha256(weights) == ref_sha,
                "reason": j.get("reason", "")})
            rows.append(row)
            print(f"{job_id}: killed at step {row['kill_step']}, every daemon back after "
                  f"{row['rereg']} s (kill to re-adopted {row['kill_to_adopted']} s), "
                  f"{row['state']}, restarts {row['restarts']}, same attempt "
                  f"{row['same_attempt']}, every step once {row['steps_once']}, same weights "
                  f"{row['same_weights']}", flush=True)
    finally:
        cluster.stop()
    elapsed = time.time() - started

    def good(r):
        return (r["state"] == "SUCCEEDED" and r["restarts"] == 0 and r["same_attempt"] and
                r["steps_once"] and r["same_weights"] and r["rereg"] is not None and
                r["rereg"] <= 30)

    transport = "plaintext (--insecure)" if a.insecure else "TLS, a certificate per daemon"
    print()
    print(f"| rep | job | killed at step | daemons back after restart | kill → re-adopted | "
          f"outcome |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        rereg = f"{r['rereg']:.2f} s" if r["rereg"] is not None else "never"
        k2a = f"{r['kill_to_adopted']:.2f} s" if r["kill_to_adopted"] is not None else "—"
        outcome = ("SUCCEEDED, same attempt, no restart, every step once, same weights"
                   if good(r) else f"**{r['state']}** (restarts {r['restarts']}): {r['reason']}")
        print(f"| {i + 1} | {r['job']} | {r['kill_step']} | {rereg} | {k2a} | {outcome} |")
    back = [r["rereg"] for r in rows if r["rereg"] is not None]
    print()
    print(f"{transport}; p = {a.pipeline}, {a.steps} steps, checkpoint every {a.every}, "
          f"coordinator down {a.down:g} s per kill; {sum(good(r) for r in rows)} / {len(rows)} "
          f"repetitions good", end="")
    if back:
        print(f"; re-registration median {statistics.median(back):.2f} s, max {max(back):.2f} s",
              end="")
    print(f"; {len(skipped)} jobs not RUNNING at their kill step (not counted); wall time "
          f"{elapsed / 60:.1f} min")
    sys.exit(0 if rows and all(good(r) for r in rows) else 1)


if __name__ == "__main__":
    main()
