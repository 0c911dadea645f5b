#!/usr/bin/env bash
# A multi-host run on one machine. Three network namespaces joined by veth pairs to a bridge
# (traffic never leaves the machine, and each namespace has its own loopback):
#   hub  10.213.7.1  the coordinator and the CLI
#   a    10.213.7.2  worker daemon, own hostname (UTS namespace) vp-host-a, --rank-hint 1
#   b    10.213.7.3  worker daemon, own hostname vp-host-b,               --rank-hint 0
# Checks: with --address auto each daemon advertises its namespace's address (`vocabpipe
# workers`), ranks follow the hints, a p=2 job SUCCEEDS with its checkpoint (its ranks could
# only reach each other at those addresses: 127.0.0.1 in one namespace is not the other's),
# SIGTERM stops a daemon with exit code 0; then daemons that advertise 127.0.0.1 on two hosts
# get their job refused with an error naming the address.
# Usage: multihost_netns_test.sh BUILD_DIR. Needs root (ip netns); exits 77 (skipped) without.
set -euo pipefail
source "$(dirname "$0")/netns_lib.sh"
build="$(cd "${1:?usage: multihost_netns_test.sh BUILD_DIR}" && pwd)"
vp="$build/client/vocabpipe"
worker="$build/worker/main/vocabpipe-worker"
coordinator_bin="$build/coordinator/server/vocabpipe-coordinator"

if [ "$(id -u)" -ne 0 ] || ! command -v ip >/dev/null || ! command -v unshare >/dev/null; then
  echo "SKIP: needs root, ip (iproute2) and unshare"; exit 77
fi
tag="vp$$"
ns_hub="${tag}hub" ns_a="${tag}a" ns_b="${tag}b"
dir="$(mktemp -d /tmp/vocabpipe-netns.XXXXXX)"
pids=()

cleanup() {
  set +e
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
  for ns in "$ns_hub" "$ns_a" "$ns_b"; do ip netns del "$ns" 2>/dev/null; done
  if [ "${keep:-0}" = 1 ]; then echo "logs kept in $dir"; else rm -rf "$dir"; fi
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; keep=1; for f in "$dir"/*.log; do echo "== $f"; tail -n 20 "$f"; done; exit 1; }

if ! ip netns add "$ns_hub" 2>/dev/null; then echo "SKIP: cannot create network namespaces"; exit 77; fi
netns_bridge 10.213.7 "$ns_hub" "$ns_a" "$ns_b"

# Data and the job spec (the CLI resolves relative paths against the spec's folder).
"$vp" data synth --vocab 64 --tokens 20000 --seed 5 --out "$dir/data.bin" >/dev/null
cat > "$dir/job.yaml" <<YAML
name: netns
model: {layers: 2, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16}
parallel: {pipeline: 2, microbatch_size: 2, microbatches: 4}
train: {steps: 6, lr: 0.003, threads: 1}
data: {path: $dir/data.bin}
checkpoint: {dir: $dir/ckpt, every: 3}
YAML

# TLS (the hub's address is not loopback): certificates with the hub's IP, an admin token.
"$vp" certs init "$dir/certs" --hosts 10.213.7.1 > /dev/null || fail "certs init"
export VOCABPIPE_TOKEN="$("$vp" certs token test --role admin --tokens "$dir/tokens")"
export VOCABPIPE_TLS_CA="$dir/certs/ca.pem"
ip netns exec "$ns_hub" "$coordinator_bin" --listen 10.213.7.1:0 --db "$dir/c.db" --no-profile \
  --tls-cert "$dir/certs/server.pem" --tls-key "$dir/certs/server-key.pem" \
  --tls-ca "$dir/certs/ca.pem" --tokens "$dir/tokens" --storage-root none \
  --heartbeat-interval 0.2 --heartbeat-timeout 3 --rank-timeout 30 > "$dir/coordinator.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do
  grep -q "listening on 10.213.7.1:" "$dir/coordinator.log" && break
  sleep 0.1
done
port="$(sed -n 's/.*listening on 10.213.7.1:\([0-9]*\).*/\1/p' "$dir/coordinator.log" | head -n 1)"
[ -n "$port" ] || fail "coordinator did not start"
coord="10.213.7.1:$port"
cli() { ip netns exec "$ns_hub" "$vp" "$@" --coordinator "$coord"; }

# start_worker NS HOSTNAME LOG ARGS...: a daemon in NS under its own hostname.
start_worker() {
  local ns="$1" host="$2" log="$3"
  shift 3
  ip netns exec "$ns" unshare --uts sh -c 'hostname "$0"; exec "$@"' "$host" \
    "$worker" --coordinator "$coord" --tls-ca "$dir/certs/ca.pem" \
    --tls-cert "$dir/certs/worker.pem" --tls-key "$dir/certs/worker-key.pem" "$@" \
    > "$dir/$log" 2>&1 &
  pids+=($!)
}
wait_workers() {  # wait_workers N: until N workers are registered
  for _ in $(seq 1 150); do
    [ "$(cli workers --output json | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))')" = "$1" ] && return 0
    sleep 0.2
  done
  fail "$1 workers did not register"
}

start_worker "$ns_a" vp-host-a a.log --rank-hint 1
pid_a=${pids[-1]}
start_worker "$ns_b" vp-host-b b.log --rank-hint 0
pid_b=${pids[-1]}
wait_workers 2
cli workers --output json > "$dir/workers.json"
python3 - "$dir/workers.json" <<'PY' || fail "workers do not advertise their namespaces' addresses"
import json, sys
w = {x["hostname"]: x for x in json.load(open(sys.argv[1]))}
assert w["vp-host-a"]["address"] == "10.213.7.2", w
assert w["vp-host-b"]["address"] == "10.213.7.3", w
PY
echo "ok: workers advertise 10.213.7.2 and 10.213.7.3 (--address auto)"

job="$(cli submit "$dir/job.yaml")" || fail "submit"
cli watch "$job" > "$dir/watch.log" 2>&1 || fail "job $job did not succeed"
cli status "$job" --output json > "$dir/status.json"
python3 - "$dir/status.json" "$dir/workers.json" <<'PY' || fail "job state or ranks"
import json, sys
job = json.load(open(sys.argv[1]))
job = job[0] if isinstance(job, list) else job
assert job["state"] in ("SUCCEEDED", "JOB_STATE_SUCCEEDED"), job["state"]
workers = {x["worker_id"]: x["hostname"] for x in json.load(open(sys.argv[2]))}
by_rank = {s["rank"]: workers[s["worker_id"]] for s in job["stages"]}
assert by_rank == {0: "vp-host-b", 1: "vp-host-a"}, by_rank
PY
[ -n "$(ls -A "$dir/ckpt/step_6" 2>/dev/null)" ] || fail "no checkpoint $dir/ckpt/step_6"
echo "ok: p=2 job $job SUCCEEDED across namespaces; rank 0 on vp-host-b, rank 1 on vp-host-a (hints)"

# SIGTERM: a clean stop, exit code 0 (not 143).
for pid in "$pid_a" "$pid_b"; do
  kill -TERM "$pid"
  rc=0
  wait "$pid" || rc=$?
  [ "$rc" -eq 0 ] || fail "worker pid $pid exited $rc on SIGTERM"
done
echo "ok: SIGTERM stops both daemons with exit code 0"

# Loopback on two hosts: refused with an error that names the address.
start_worker "$ns_a" vp-host-a a2.log --address 127.0.0.1
start_worker "$ns_b" vp-host-b b2.log --address 127.0.0.1
for _ in $(seq 1 50); do  # the stopped daemons leave the list after the heartbeat timeout
  n="$(cli workers --output json | python3 -c 'import json,sys; w=json.load(sys.stdin); print(len(w) == 2 and all(x["address"] == "127.0.0.1" for x in w))')"
  [ "$n" = True ] && break
  sleep 0.2
done
job="$(cli submit "$dir/job.yaml")" || fail "submit"
rc=0
cli watch "$job" > "$dir/watch2.log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "a job over loopback addresses on two hosts was not refused"
grep -q "advertises loopback address 127.0.0.1" "$dir/watch2.log" || \
  { cli status "$job" > "$dir/status2.log" 2>&1; grep -q "loopback" "$dir/status2.log"; } || \
  fail "the refusal does not name the loopback address"
echo "ok: a two-host job over 127.0.0.1 is refused"
echo PASS
