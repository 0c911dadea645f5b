"""What the reliability benchmarks share (reliability_bench.py, readopt_bench.py): a
vocabpipe-coordinator and worker daemons on loopback, started from a build folder and driven
through the `vocabpipe` CLI, and the tiny job they run. Standard library only; the scripts
import it from their own folder.
"""
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def prepare_workdir(a, prefix):
    """--workdir (or a new temporary folder named `prefix`...) with the jobs' data.bin in it."""
    work = a.workdir or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(work, exist_ok=True)
    subprocess.run([os.path.join(a.bin, "client", "vocabpipe"), "data", "synth", "--vocab", "64",
                    "--tokens", "20000", "--seed", "5", "--out", os.path.join(work, "data.bin")],
                   check=True, stdout=subprocess.DEVNULL)
    return work


def spec_text(a, name, max_restarts=None):
    """The benchmarks' job: L = 2, h = 32, V = 64, s = 16, m = 4 microbatches of b = 2, p =
    --pipeline, --steps steps, a checkpoint every --every into the folder `name`."""
    restarts = "" if max_restarts is None else f", max_restarts: {max_restarts}"
    return (f"name: {name}\n"
            f"model: {{layers: 2, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16}}\n"
            f"parallel: {{pipeline: {a.pipeline}, microbatch_size: 2, microbatches: 4, "
            f"vocab: vocab2, schedule: 1f1b}}\n"
            f"train: {{steps: {a.steps}, lr: 0.003, threads: 1{restarts}}}\n"
            f"data: {{path: data.bin}}\ncheckpoint: {{dir: {name}, every: {a.every}}}\n")


class Cluster:
    """A coordinator at a free loopback port and the worker daemons of a benchmark. A script's
    subclass starts them (self.coordinator, self.daemons: Popen objects); this class speaks to
    the coordinator through the CLI and stops them all.

    client_flags: what every CLI call to the coordinator adds (["--insecure"], or none where the
    TLS CA and token come from self.env)."""

    def __init__(self, a, work, client_flags):
        self.a = a
        self.work = work
        self.address = f"127.0.0.1:{free_port()}"
        self.cli = os.path.join(a.bin, "client", "vocabpipe")
        self.env = dict(os.environ)
        self.client_flags = list(client_flags)
        self.coordinator = None
        self.daemons = []

    def coordinator_args(self, rank_timeout, *flags):
        """The coordinator's command line on WORK/coordinator.db: fast heartbeats, no profiling."""
        return [os.path.join(self.a.bin, "coordinator", "server", "vocabpipe-coordinator"),
                "--listen", self.address, "--db", os.path.join(self.work, "coordinator.db"),
                "--no-profile", "--heartbeat-interval", "0.25", "--heartbeat-timeout", "2",
                "--rank-timeout", str(rank_timeout), *flags]

    def worker_args(self, *flags):
        """A worker daemon's command line."""
        return [os.path.join(self.a.bin, "worker", "main", "vocabpipe-worker"), "--coordinator",
                self.address, *flags]

    def coordinator_flags(self):
        """What a CLI call to the coordinator adds: its address, and client_flags."""
        return ["--coordinator", self.address, *self.client_flags]

    def run_cli(self, *args):
        r = subprocess.run([self.cli, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env=self.env)
        if r.returncode != 0:
            raise RuntimeError(f"vocabpipe {' '.join(args)}: {r.stdout}")
        return r.stdout

    def ctl(self, *args):
        return self.run_cli(*args, *self.coordinator_flags())

    def workers(self):
        return json.loads(self.ctl("workers", "--output", "json"))

    def wait_workers(self, n, limit=30):
        end = time.time() + limit
        while time.time() < end:
            try:
                if len(self.workers()) >= n:
                    return
            except RuntimeError:
                pass
            time.sleep(0.2)
        sys.exit(f"fewer than {n} workers registered within {limit} s")

    def job(self, job_id):
        return json.loads(self.ctl("status", job_id, "--output", "json"))

    def wait_state(self, job_id, states, limit):
        end = time.time() + limit
        while time.time() < end:
            j = self.job(job_id)
            if j["state"] in states:
                return j
            time.sleep(0.1)
        return self.job(job_id)

    def submit(self, name, max_restarts=None):
        """Writes WORK/`name`.yaml (spec_text) and submits it; returns the job's id."""
        path = os.path.join(self.work, f"{name}.yaml")
        with open(path, "w") as f:
            f.write(spec_text(self.a, name, max_restarts))
        return self.ctl("submit", path).strip().splitlines()[-1].strip()

    def weights(self, name):
        """The final merged weights of the job whose checkpoint folder is `name`."""
        return os.path.join(self.work, name, f"step_{self.a.steps}", "model.safetensors")

    def reference(self, max_restarts=None):
        """Runs the uninterrupted reference job to the end; returns it and its weights' SHA-256
        (exits if it did not succeed)."""
        ref_id = self.submit("reference", max_restarts)
        ref = self.wait_state(ref_id, TERMINAL, self.a.timeout_per_job)
        if ref["state"] != "SUCCEEDED":
            sys.exit(f"reference job {ref['state']}: {ref.get('reason', '')}")
        return ref, sha256(self.weights("reference"))

    def stop(self):
        for p in self.daemons + [self.coordinator]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.daemons + [self.coordinator]:
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
