#!/usr/bin/env bash
# Control-plane overhead: what vocabpipe-coordinator + vocabpipe-worker daemons (heartbeats,
# per-step metric reports, gRPC store rendezvous, event log) cost a 2-rank job, against the
# same job with no control plane.
#
#   bench/control/overhead.sh BUILD_DIR [STEPS=12] [PAIRS=5]
#
# Needs the targets vocabpipe, vocabpipe-coordinator and vocabpipe-worker built in BUILD_DIR.
#
# A = `vocabpipe run SPEC --direct`: the rank processes are started by the CLI itself
#     (launch::RunPipelineJob). A binary whose `run` usage does not mention --direct is from
#     before the control plane became `run`'s default: there plain `vocabpipe run` is the
#     local launcher, and the script uses that (it says which it used).
# B = one standalone vocabpipe-coordinator (--no-profile) and two vocabpipe-worker
#     --coordinator daemons, started once and reused by every B run; each run is
#     `vocabpipe submit` + `vocabpipe watch --output json`.
# Both execute the same rank binary on the same spec, so the rank work is identical.
#
# Two measures, because on a small shared machine step times drift by several percent from
# one run to the next, which hides an overhead of well under 1%:
#
# 1. Step time, A/B interleaved in PAIRS pairs (AB, BA, AB, ...: slow drift and any
#    first-of-the-pair effect hit both alike).
#    Per run the median step time (the first, warm-up step skipped); per pair the ratio B/A.
#    The spread of the pair ratios (min..max) is the noise band: an effect inside it is not
#    resolved by this measure.
#
# 2. CPU accounting, which noise does not move: the control plane's own CPU time divided by
#    the ranks' CPU time over the same B run.
#    - control plane = utime+stime (/proc/PID/stat fields 14, 15) of the coordinator and of
#      both daemon processes, sampled right before `submit` and again after the job ended and
#      its ranks were reaped. This is all threads of those processes (gRPC, heartbeats,
#      SQLite, metric tailing), not their children.
#    - ranks = cutime+cstime (fields 16, 17) deltas of the two daemons over the same window.
#      The rank processes are the daemons' only children and the kernel adds a child's CPU
#      to cutime/cstime when the parent reaps it, so the "after" sample is taken only once
#      no process has a daemon as parent any more (scanning /proc/*/stat for the ppid).
#      No per-rank log or pid bookkeeping is needed, and a rank's exited threads are
#      counted (live-thread sampling would miss them).
#    - the clients (`submit`, `watch`) are the user's side, reported apart
#      (getrusage(RUSAGE_CHILDREN) of the driver around them).
#    - for scale, A's own supervisor: the `vocabpipe run` process's utime+stime (read from
#      /proc every 50 ms until it exits) against its reaped ranks' CPU (getrusage
#      RUSAGE_CHILDREN delta minus that).
#    - idle: the same coordinator+daemon counters over each A run, when no job is
#      assigned: the heartbeat floor, also present (as noise) while A runs.
#    Resolution is one clock tick (10 ms at USER_HZ 100) per counter; the summary uses the
#    sums over all B runs, so that is a small fraction of the total.
#    "CPU per step" = control-plane CPU over all B runs / (STEPS x runs), next to the median
#    A step time: the share of a step's wall time the control plane would cost if its CPU
#    were all on the critical path (an upper bound: it mostly runs beside the ranks). It
#    includes the per-job costs (submit, planning, start, exit), amortized over STEPS; the
#    "steady state" figure excludes them: the same counters sampled when `watch` prints the
#    first and the last step event, divided by STEPS-1.
#
# The last line is the summary:
#   overhead: step-time ratio median +x.xx% (range a..b over N pairs); control-plane CPU
#   y.yy% of rank CPU; z.zz ms CPU per step
set -euo pipefail
usage='usage: bench/control/overhead.sh BUILD_DIR [STEPS] [PAIRS]'
build=${1:?$usage}
steps=${2:-12}
pairs=${3:-5}
build=$(cd "$build" && pwd)
vp=$build/client/vocabpipe
coordinator=$build/coordinator/server/vocabpipe-coordinator
worker=$build/worker/main/vocabpipe-worker
for b in "$vp" "$coordinator" "$worker"; do
  [[ -x $b ]] || { echo "overhead.sh: $b is not built" >&2; exit 2; }
done

work=$(mktemp -d)
pids=()  # coordinator and daemons, stopped by pid on exit
cleanup() {
  local p
  for p in ${pids[@]+"${pids[@]}"}; do kill "$p" 2>/dev/null || true; done
  for p in ${pids[@]+"${pids[@]}"}; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
cd "$work"

run_usage=$("$vp" run --help 2>&1 || true)
if [[ $run_usage == *--direct* ]]; then direct=1; else direct=0; fi

"$vp" data synth --vocab 8192 --tokens 200000 --out data.bin > /dev/null

"$coordinator" --listen 127.0.0.1:0 --db c.db --no-profile --insecure > coord.log 2>&1 &
pids+=($!)
coord_pid=$!
for _ in $(seq 100); do grep -q listening coord.log && break; sleep 0.1; done
addr=$(grep -o '127.0.0.1:[0-9]*' coord.log | head -1)
[[ -n $addr ]] || { echo "overhead.sh: coordinator did not start:" >&2; cat coord.log >&2; exit 1; }
"$worker" --coordinator "$addr" --insecure > w0.log 2>&1 &
pids+=($!)
w0_pid=$!
"$worker" --coordinator "$addr" --insecure > w1.log 2>&1 &
pids+=($!)
w1_pid=$!

python3 - "$vp" "$addr" "$coord_pid" "$w0_pid" "$w1_pid" "$steps" "$pairs" "$direct" <<'PY'
import json, os, resource, statistics, subprocess, sys, time

vp, addr = sys.argv[1], sys.argv[2]
coord, w0, w1, steps, pairs, direct = map(int, sys.argv[3:])
daemons = (w0, w1)
tick = os.sysconf("SC_CLK_TCK")


def proc_stat(pid):
    """(self CPU s, reaped children CPU s, ppid) from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        s = f.read()
    rest = s[s.rindex(")") + 2:].split()  # rest[0] is field 3 (state)
    ppid = int(rest[1])
    utime, stime, cutime, cstime = map(int, rest[11:15])  # fields 14..17
    return (utime + stime) / tick, (cutime + cstime) / tick, ppid


def children_of(parents):
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if proc_stat(int(d))[2] in parents:
                    found.append(int(d))
            except (OSError, ValueError, IndexError):
                pass  # exited while scanning
    return found


def wait_reaped(timeout=60):
    until = time.monotonic() + timeout
    while children_of(daemons):
        if time.monotonic() > until:
            sys.exit("overhead.sh: rank processes still running after the job ended")
        time.sleep(0.05)


def sample():
    return {p: proc_stat(p) for p in (coord,) + daemons}


def control_cpu(s0, s1):
    return sum(s1[p][0] - s0[p][0] for p in s0)


def rank_cpu(s0, s1):
    return sum(s1[p][1] - s0[p][1] for p in daemons)


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def write_spec(name):
    with open(f"{name}.yaml", "w") as f:
        f.write(f"""name: {name}
model: {{layers: 4, hidden: 256, heads: 4, vocab_size: 8192, seq_len: 128}}
parallel: {{pipeline: 2, microbatch_size: 2, microbatches: 4, schedule: 1f1b, vocab: vocab2}}
train: {{steps: {steps}, threads: 1}}
data: {{path: data.bin}}
checkpoint: {{dir: {name}}}
""")


def median_step(seconds):
    if len(seconds) != steps:
        sys.exit(f"overhead.sh: expected {steps} steps, got {len(seconds)}")
    return statistics.median(seconds[1:])  # skip the warm-up step


def run_a(i):
    name = f"a{i}"
    write_spec(name)
    s0, c0, t0 = sample(), children_cpu(), time.monotonic()
    # The launcher's own CPU: its /proc stat read every 50 ms until it exits (the last read
    # may be of the zombie, which holds the final counts); at most 50 ms of it is missed.
    launcher = 0.0
    with subprocess.Popen([vp, "run", f"{name}.yaml"] + (["--direct"] if direct else []),
                          stdout=subprocess.DEVNULL) as run:
        while True:
            try:
                launcher = proc_stat(run.pid)[0]
            except (OSError, ValueError, IndexError):
                pass
            if run.poll() is not None:
                break
            time.sleep(0.05)
    if run.returncode != 0:
        sys.exit(f"overhead.sh: vocabpipe run {name}.yaml exited {run.returncode}")
    wall, cpu, s1 = time.monotonic() - t0, children_cpu() - c0, sample()
    with open(f"{name}/metrics.jsonl") as f:
        secs = [json.loads(l)["step_seconds"] for l in f if l.strip()]
    return dict(step=median_step(secs), cpu=cpu, launcher=launcher, wall=wall,
                idle=control_cpu(s0, s1))


def run_b(i):
    name = f"b{i}"
    write_spec(name)
    wait_reaped()
    s0, c0, t0 = sample(), children_cpu(), time.monotonic()
    job = subprocess.run([vp, "submit", f"{name}.yaml", "--coordinator", addr, "--insecure"],
                         capture_output=True, text=True, check=True).stdout.strip()
    # Follow the event stream; sample at the first and at every later step event, so the
    # steady-state cost (first to last step, no submit/plan/start/exit) is separable.
    events, first, last = [], None, None
    with subprocess.Popen([vp, "watch", job, "--coordinator", addr, "--insecure", "--output", "json"],
                          stdout=subprocess.PIPE, text=True) as watch:
        for line in watch.stdout:
            if line.strip():
                events.append(json.loads(line))
                if "step" in events[-1]:
                    last = sample()
                    first = first or last
    if watch.returncode != 0:
        sys.exit(f"overhead.sh: vocabpipe watch {job} exited {watch.returncode}")
    wait_reaped()
    wall, client, s1 = time.monotonic() - t0, children_cpu() - c0, sample()
    states = [e["state"] for e in events if "state" in e]
    if not states or states[-1] != "SUCCEEDED":
        sys.exit(f"overhead.sh: job {job} ended {states[-1:]}")
    secs = [e["step"]["seconds"] for e in events if "step" in e]
    return dict(step=median_step(secs), control=control_cpu(s0, s1), ranks=rank_cpu(s0, s1),
                steady=control_cpu(first, last), client=client, wall=wall)


print(f"A = vocabpipe run {'--direct' if direct else '(local launcher, no --direct flag)'}; "
      f"B = coordinator + 2 daemons; {steps} steps, {pairs} pairs")
print(f"{'pair':>4} {'A step ms':>9} {'B step ms':>9} {'B/A':>8} {'A cpu s':>8} "
      f"{'B rank s':>8} {'B ctl s':>8} {'client s':>8} {'idle ctl s':>10}")
A, B = [], []
for i in range(pairs):
    if i % 2 == 0:  # ABBA order: a first-run-of-the-pair effect cancels in the median
        a, b = run_a(i), run_b(i)
    else:
        b, a = run_b(i), run_a(i)
    A.append(a)
    B.append(b)
    print(f"{i:>4} {a['step']*1e3:>9.2f} {b['step']*1e3:>9.2f} "
          f"{100*(b['step']/a['step']-1):>+7.2f}% {a['cpu']:>8.2f} {b['ranks']:>8.2f} "
          f"{b['control']:>8.2f} {b['client']:>8.2f} {a['idle']:>10.2f}", flush=True)

ratios = [100 * (b["step"] / a["step"] - 1) for a, b in zip(A, B)]
control = sum(b["control"] for b in B)
ranks = sum(b["ranks"] for b in B)
client = sum(b["client"] for b in B)
idle = sum(a["idle"] for a in A)
a_step = statistics.median(a["step"] for a in A)
per_step = control / (steps * len(B))
a_launcher = sum(a["launcher"] for a in A)
a_ranks = sum(a["cpu"] for a in A) - a_launcher
print(f"A: launcher CPU {a_launcher:.2f} s = {100*a_launcher/a_ranks:.2f}% of its rank CPU "
      f"{a_ranks:.2f} s (the no-control-plane baseline's own supervision cost)")
print(f"A total CPU (launcher + ranks) {sum(a['cpu'] for a in A):.2f} s, B rank CPU "
      f"{ranks:.2f} s, B control-plane CPU {control:.2f} s, B clients (submit+watch) "
      f"{client:.2f} s; idle control plane during A {idle:.2f} s over "
      f"{sum(a['wall'] for a in A):.1f} s")
steady = sum(b["steady"] for b in B) / ((steps - 1) * len(B))
print(f"control-plane CPU per step {per_step*1e3:.2f} ms = {100*per_step/a_step:.2f}% of the "
      f"median A step ({a_step*1e3:.1f} ms); steady state (first to last step event) "
      f"{steady*1e3:.2f} ms = {100*steady/a_step:.2f}%")
print(f"overhead: step-time ratio median {statistics.median(ratios):+.2f}% "
      f"(range {min(ratios):+.2f}%..{max(ratios):+.2f}% over {len(ratios)} pairs); "
      f"control-plane CPU {100*control/ranks:.2f}% of rank CPU; {per_step*1e3:.2f} ms CPU "
      f"per step")
PY
