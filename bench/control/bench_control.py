"""What the control-plane benches share: running a command, waiting for a log line, and a real
vocabpipe-coordinator over TLS with its certificates and an admin token."""
import os
import re
import subprocess
import sys
import time


def run(cmd, env=None, **kw):
    """The command's output; exits naming it when it fails."""
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                       **kw)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}")
    return r.stdout


def wait_line(path, pattern, seconds=30):
    """The first match of `pattern` in the file at `path`, waiting up to `seconds` for it."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if os.path.exists(path):
            m = re.search(pattern, open(path).read())
            if m:
                return m
        time.sleep(0.1)
    sys.exit(f"no '{pattern}' in {path}:\n" + (open(path).read() if os.path.exists(path) else ""))


def pki(vocabpipe, work, worker_names=()):
    """WORK/certs (a CA, the coordinator's and the named workers' certificates) and an admin
    token in WORK/tokens: (certs folder, token)."""
    certs = os.path.join(work, "certs")
    if not os.path.exists(os.path.join(certs, "ca.pem")):
        run([vocabpipe, "certs", "init", certs])
        for name in worker_names:
            run([vocabpipe, "certs", "worker", name, certs])
    tokens = os.path.join(work, "tokens")
    token = run([vocabpipe, "certs", "token", "bench", "--tokens", tokens,
                 "--role", "admin"]).strip().split()[-1]
    return certs, token


def start_coordinator(coordinator, work, certs, db, log, extra=(), wrap=()):
    """A coordinator over TLS on a fresh SQLite file `db` (its log in `log`, storage root
    `work`, --no-profile): (process, "127.0.0.1:PORT")."""
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(db + suffix):
            os.remove(db + suffix)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            list(wrap) + [coordinator, "--listen", "127.0.0.1:0", "--db", db,
                          "--tls-cert", os.path.join(certs, "server.pem"),
                          "--tls-key", os.path.join(certs, "server-key.pem"),
                          "--tls-ca", os.path.join(certs, "ca.pem"),
                          "--tokens", os.path.join(work, "tokens"),
                          "--no-profile", "--storage-root", work] + list(extra),
            stdout=out, stderr=subprocess.STDOUT, cwd=work)
    port = wait_line(log, r"listening on [^\s:]+:(\d+)").group(1)
    return proc, f"127.0.0.1:{port}"


def synth_data(vocabpipe, work):
    """WORK/data.bin: 100,000 synthetic tokens of a 64-token vocabulary."""
    data = os.path.join(work, "data.bin")
    if not os.path.exists(data):
        run([vocabpipe, "data", "synth", "--vocab", "64", "--tokens", "100000", "--out", data,
             "--seed", "1"])
    return data
