#!/usr/bin/env python3
"""Reliability soak (issue 16): a real vocabpipe-coordinator and real worker daemons on
loopback (p for the job plus spares), small p-rank jobs submitted one after another, and in
each job one worker daemon of a random rank killed with SIGKILL at a random step. The
coordinator must notice (heartbeat timeout or the peers' transport error), restart the job on
the survivors and a spare from the newest verified checkpoint, and the job must still succeed
with the result of an uninterrupted run. A replacement daemon is started after every kill, so
the pool stays the same size.

usage: reliability_bench.py --bin BUILD [--n 50] [--pipeline 2] [--spares 1] [--steps 30]
         [--every 5] [--seed 1] [--workdir DIR] [--timeout-per-job 120]

Reports: jobs completed, restarts, steps run again (recorded steps lost to the kill: the
last step recorded before the job's last restart minus the step its last attempt resumed
from), time
from the kill to the job running again, and agreement with an uninterrupted reference run of
the same spec (final loss, and the final weights' SHA-256). Prints a markdown table; exits 1
if any job did not succeed.
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
    """The coordinator and the worker daemons, all started (and stopped) by this script."""

    def __init__(self, a, work):
        super().__init__(a, work, ["--insecure"])
        self.started = 0
        self.coordinator = subprocess.Popen(
            self.coordinator_args(5, "--insecure"),
            stdout=open(os.path.join(work, "coordinator.log"), "w"), stderr=subprocess.STDOUT)
        for _ in range(a.pipeline + a.spares):
            self.start_daemon()
        self.wait_workers(a.pipeline + a.spares)

    def start_daemon(self):
        self.started += 1
        log = open(os.path.join(self.work, f"worker_{self.started}.log"), "w")
        self.daemons.append(subprocess.Popen(
            self.worker_args("--insecure", "--exit-with-parent", "1"),
            stdout=log, stderr=subprocess.STDOUT))

    def events(self, job_id):
        out = self.ctl("watch", job_id, "--output", "json")
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True, help="the build folder (BUILD/client/vocabpipe ...)")
    ap.add_argument("--n", type=int, default=50, help="daemons to kill (one per job)")
    ap.add_argument("--pipeline", type=int, default=2)
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5, help="checkpoint.every")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--timeout-per-job", type=float, default=120)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    work = prepare_workdir(a, "vp_reliability_")
    started = time.time()
    cluster = Cluster(a, work)
    rows = []
    try:
        # The uninterrupted reference.
        ref, ref_sha = cluster.reference(max_restarts=0)
        # A job that ends before its kill step is seen (a slow poll) counts as a job, not a
        # kill: jobs go on until n daemons were killed (at most 2n jobs).
        i = 0
        while sum(1 for r in rows if r["killed"]) < a.n and i < 2 * a.n:
            name = f"soak{i}"
            i += 1
            target = rng.randint(1, a.steps - 2)  # kill after this many recorded steps
            victim_rank = rng.randrange(a.pipeline)
            job_id = cluster.submit(name, max_restarts=10)
            end = time.time() + a.timeout_per_job
            killed_pid, killed_at, kill_step = None, None, None
            while time.time() < end and killed_pid is None:
                j = cluster.job(job_id)
                if j["state"] in TERMINAL:
                    break
                if j["state"] == "RUNNING" and j.get("step", 0) >= target:
                    for w in cluster.workers():
                        if w.get("job_id") == job_id and w.get("rank", -1) == victim_rank:
                            killed_pid = w["pid"]
                    if killed_pid is not None:
                        kill_step = j.get("step", 0)
                        os.kill(killed_pid, signal.SIGKILL)
                        killed_at = time.time()
                time.sleep(0.02)
            # Reap the killed daemon and keep the pool's size.
            for p in list(cluster.daemons):
                if p.pid == killed_pid:
                    p.wait()
                    cluster.daemons.remove(p)
            if killed_pid is not None:
                cluster.start_daemon()
                # The next job must not be scheduled on the dead daemon before the coordinator
                # drops it (heartbeat timeout): each job sees its own kill only.
                drop_end = time.time() + 30
                while time.time() < drop_end and any(
                        w.get("pid") == killed_pid for w in cluster.workers()):
                    time.sleep(0.2)
            j = cluster.wait_state(job_id, TERMINAL, max(1.0, end - time.time()))
            events = cluster.events(job_id)
            # recorded: the last step the coordinator recorded before the job's last restart.
            recorded, last, lost, back_after = 0, 0, None, None
            restarted, restarts = False, 0
            for e in events:
                if "step" in e and isinstance(e["step"], dict):
                    last = e["step"].get("step", 0)
                elif e.get("state") == "PENDING" and "restart" in e.get("message", ""):
                    restarted = True
                    restarts += 1
                    recorded = last
                elif restarted and e.get("state") == "RUNNING" and back_after is None and \
                        killed_at is not None:
                    back_after = e["unix_ms"] / 1000.0 - killed_at
            # The step the last attempt resumed from: the first line of its rank 0 report.
            resumed = None
            try:
                with open(os.path.join(work, name, "rank_0.jsonl")) as f:
                    resumed = json.loads(f.readline())["step"]
            except (OSError, ValueError, KeyError):
                pass
            if restarted and resumed is not None:
                lost = recorded - resumed
            weights = cluster.weights(name)
            same = os.path.exists(weights) and sha256(weights) == ref_sha
            rows.append({
                "job": job_id, "state": j["state"], "restarts": restarts,
                "kill_step": kill_step, "killed": killed_pid is not None, "lost": lost,
                "back_after": back_after, "loss": j.get("loss"), "same_weights": same,
                "reason": j.get("reason", "")})
            print(f"{job_id}: {j['state']}, killed rank {victim_rank} at step {kill_step}, "
                  f"restarts {restarts}, steps run again {lost}, "
                  f"loss {j.get('loss')} (reference {ref.get('loss')}), same weights {same}",
                  flush=True)
    finally:
        cluster.stop()
    elapsed = time.time() - started
    done = [r for r in rows if r["state"] == "SUCCEEDED"]
    killed = [r for r in rows if r["killed"]]
    lost = [r["lost"] for r in rows if r["lost"] is not None]
    back = [r["back_after"] for r in rows if r["back_after"] is not None]
    dloss = [abs(r["loss"] - ref["loss"]) for r in done if r["loss"] is not None]
    print()
    print(f"| soak: p = {a.pipeline} (+{a.spares} spare), {a.steps} steps, checkpoint every "
          f"{a.every}, {len(rows)} jobs, one SIGKILL each | result |")
    print("|---|---|")
    print(f"| jobs completed (SUCCEEDED) | {len(done)} / {len(rows)} |")
    print(f"| daemons killed | {len(killed)} |")
    print(f"| restarts (sum over jobs) | {sum(r['restarts'] for r in rows)} |")
    if lost:
        print(f"| steps run again per kill: mean / max (sum) | {statistics.mean(lost):.2f} / "
              f"{max(lost)} ({sum(lost)}) |")
    if back:
        print(f"| kill to RUNNING again: median / max | {statistics.median(back):.1f} s / "
              f"{max(back):.1f} s |")
    if dloss:
        print(f"| final loss vs the uninterrupted run: max abs difference | {max(dloss):.3g} |")
    print(f"| final weights bit-identical to the uninterrupted run | "
          f"{sum(1 for r in done if r['same_weights'])} / {len(done)} |")
    print(f"| wall time | {elapsed / 60:.1f} min |")
    failed = [r for r in rows if r["state"] != "SUCCEEDED"]
    for r in failed:
        print(f"{r['job']}: {r['state']}: {r['reason']}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
