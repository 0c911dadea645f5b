#!/usr/bin/env bash
# deploy/slurm/vocabpipe.sbatch on a real local Slurm (slurm-wlm and munge from Debian): munged,
# slurmctld and two slurmd (node1, node2: 2 CPUs each, no GPUs; proctrack/linuxproc and
# task/none, no cgroups), each slurmd in its own network namespace joined by veth pairs to a
# bridge in the controller's namespace, so the nodes have distinct addresses and their own
# loopback. Everything runs from a generated slurm.conf in a temporary folder and is stopped by
# pid at the end.
# node1, the head of every job here, has a second address listed before its bridge address
# (mgmt0, 10.214.99.2, on a network no other node is on), as a head with a management network
# and a fast fabric has: the script must take Slurm's NodeAddr of node1, not `hostname -I`'s
# first word.
# Checks: a 2-task CPU job (VOCABPIPE_DEVICE=cpu, --cpus-per-task=2) COMPLETES with its
# checkpoint, its output holds no Killed/CANCELLED lines from the teardown, and the ranks follow
# SLURM_PROCID; a job whose worker step is refused (VOCABPIPE_DEVICE=cuda on a partition without
# GPUs) fails fast instead of waiting for its time limit.
# Usage: slurm_local_test.sh BUILD_DIR. Exits 77 (skipped) without root or the packages.
set -euo pipefail
source "$(dirname "$0")/netns_lib.sh"
build="$(cd "${1:?usage: slurm_local_test.sh BUILD_DIR}" && pwd)"
src="$(cd "$(dirname "$0")/../.." && pwd)"
for tool in munged slurmctld slurmd sbatch ip; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool not installed (scripts/setup.sh)"; exit 77; }
done
[ "$(id -u)" -eq 0 ] || { echo "SKIP: needs root (network namespaces, slurmd)"; exit 77; }

tag="vs$$"
ns_ctl="${tag}c" ns_1="${tag}1" ns_2="${tag}2"
net=10.214.7
dir="$(mktemp -d /tmp/vocabpipe-slurm.XXXXXX)"
chmod 755 "$dir"
pids=()
cleanup() {
  set +e
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
  for ns in "$ns_ctl" "$ns_1" "$ns_2"; do ip netns del "$ns" 2>/dev/null; done
  if [ "${keep:-0}" = 1 ]; then echo "logs kept in $dir"; else rm -rf "$dir"; fi
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"; keep=1
  for f in "$dir"/*.log "$dir"/*.out; do [ -f "$f" ] && { echo "== $f"; tail -n 30 "$f"; }; done
  exit 1
}

if ! ip netns add "$ns_ctl" 2>/dev/null; then echo "SKIP: cannot create network namespaces"; exit 77; fi
netns_bridge "$net" "$ns_ctl" "$ns_1" "$ns_2"
# node1's second network: a veth pair inside its namespace (lower interface numbers than eth0,
# so `hostname -I` lists this address first); nothing else can reach it.
ip -n "$ns_1" link add mgmt0 type veth peer name mgmt1
ip -n "$ns_1" addr add 10.214.99.2/24 dev mgmt0
ip -n "$ns_1" link set mgmt0 up
ip -n "$ns_1" link set mgmt1 up
first="$(ip netns exec "$ns_1" hostname -I | awk '{print $1}')"
[ "$first" = 10.214.99.2 ] || fail "node1's hostname -I starts with $first, not the unreachable 10.214.99.2"

# munge: its own key and socket (a Unix socket: every namespace reaches it through the file).
dd if=/dev/urandom of="$dir/munge.key" bs=1024 count=1 status=none
chmod 400 "$dir/munge.key"
munged --foreground --force --socket="$dir/munge.sock" --key-file="$dir/munge.key" \
  --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munged.seed" \
  >/dev/null 2>&1 &
pids+=($!)
for _ in $(seq 1 50); do [ -S "$dir/munge.sock" ] && break; sleep 0.1; done
[ -S "$dir/munge.sock" ] || fail "munged did not start"

mkdir -p "$dir/ctld" "$dir/node1" "$dir/node2"
: > "$dir/plugstack.conf"
# slurmd 22.05 loads a cgroup plugin even with proctrack/linuxproc and task/none: name the v1
# one (nothing is constrained: no cgroup-based plugin is configured).
echo "CgroupPlugin=cgroup/v1" > "$dir/cgroup.conf"
cat > "$dir/slurm.conf" <<CONF
ClusterName=vptest
SlurmctldHost=$(hostname -s)($net.1)
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
PlugStackConfig=$dir/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=5
NodeName=node1 NodeAddr=$net.2 CPUs=2 RealMemory=1000 State=UNKNOWN
NodeName=node2 NodeAddr=$net.3 CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=cpu Nodes=node1,node2 Default=YES MaxTime=30 State=UP
CONF
export SLURM_CONF="$dir/slurm.conf"

ip netns exec "$ns_ctl" slurmctld -D -i -f "$SLURM_CONF" > "$dir/slurmctld.stderr.log" 2>&1 &
pids+=($!)
ip netns exec "$ns_1" slurmd -D -N node1 -f "$SLURM_CONF" > "$dir/slurmd1.stderr.log" 2>&1 &
pids+=($!)
ip netns exec "$ns_2" slurmd -D -N node2 -f "$SLURM_CONF" > "$dir/slurmd2.stderr.log" 2>&1 &
pids+=($!)
ctl() { ip netns exec "$ns_ctl" "$@"; }
for _ in $(seq 1 100); do
  [ "$(ctl sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle')" = 2 ] && break
  sleep 0.3
done
[ "$(ctl sinfo -h -N -o "%N %t" | grep -c " idle" || true)" = 2 ] || fail "the two slurmd did not come up idle: $(ctl sinfo -N 2>&1)"
echo "ok: slurmctld and slurmd node1 ($net.2), node2 ($net.3) idle"

# The binaries in one folder (VOCABPIPE_BIN), data and a p=2 spec on the shared file system.
mkdir -p "$dir/bin"
ln -s "$build/client/vocabpipe" "$build/worker/main/vocabpipe-worker" \
  "$build/coordinator/server/vocabpipe-coordinator" "$dir/bin/"
"$dir/bin/vocabpipe" data synth --vocab 64 --tokens 20000 --seed 5 --out "$dir/data.bin" >/dev/null
cat > "$dir/job.yaml" <<YAML
name: slurm
model: {layers: 2, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16}
parallel: {pipeline: 2, microbatch_size: 2, microbatches: 4}
train: {steps: 6, lr: 0.003, threads: 1}
data: {path: $dir/data.bin}
checkpoint: {dir: $dir/ckpt, every: 3}
YAML

# The sbatch command runs in the controller's namespace (where a login node would be).
cd "$dir"
rc=0
ctl env VOCABPIPE_BIN="$dir/bin" VOCABPIPE_DEVICE=cpu VOCABPIPE_STATE="$dir/state" \
  timeout 300 sbatch --wait --nodes=2 --ntasks-per-node=1 --cpus-per-task=2 --time=5 \
  --output="$dir/cpu-%j.out" "$src/deploy/slurm/vocabpipe.sbatch" "$dir/job.yaml" \
  > "$dir/sbatch-cpu.log" 2>&1 || rc=$?
jobid="$(sed -n 's/^Submitted batch job \([0-9]*\).*/\1/p' "$dir/sbatch-cpu.log")"
[ -n "$jobid" ] || fail "sbatch did not submit: $(cat "$dir/sbatch-cpu.log")"
out="$dir/cpu-$jobid.out"
[ "$rc" -eq 0 ] || fail "CPU job $jobid: sbatch --wait exit $rc"
state="$(ctl scontrol show job "$jobid" | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p')"
[ "$state" = COMPLETED ] || fail "CPU job $jobid is $state, not COMPLETED"
grep -q "SUCCEEDED" "$out" || fail "the vocabpipe job did not report SUCCEEDED"
grep -q "head address $net.2 (from Slurm's NodeAddr of node1)" "$out" || \
  fail "the head address is not node1's NodeAddr $net.2: $(grep 'head address' "$out")"
[ -n "$(ls -A "$dir/ckpt/step_6" 2>/dev/null)" ] || fail "no checkpoint $dir/ckpt/step_6"
if grep -Eq "Killed|CANCELLED|error" "$out"; then fail "teardown noise in $out"; fi
grep -q "registered as .* address $net.2, rank hint 0" "$out" || \
  grep -q "address $net.2, rank hint 0" "$out" || fail "task 0 did not advertise $net.2 with rank hint 0"
grep -q "address $net.3, rank hint 1" "$out" || fail "task 1 did not advertise $net.3 with rank hint 1"
echo "ok: CPU job $jobid COMPLETED on node1+node2 with checkpoint step_6: $(ls "$dir/ckpt/step_6" | tr '\n' ' ')"

# A refused worker step fails the batch job fast (not PENDING until the time limit).
start=$(date +%s)
rc=0
ctl env VOCABPIPE_BIN="$dir/bin" VOCABPIPE_DEVICE=cuda VOCABPIPE_STATE="$dir/state" \
  timeout 200 sbatch --wait --nodes=2 --ntasks-per-node=1 --cpus-per-task=2 --time=5 \
  --output="$dir/gpu-%j.out" "$src/deploy/slurm/vocabpipe.sbatch" "$dir/job.yaml" \
  > "$dir/sbatch-gpu.log" 2>&1 || rc=$?
elapsed=$(( $(date +%s) - start ))
[ "$rc" -ne 0 ] || fail "a job whose worker step cannot start succeeded"
[ "$elapsed" -lt 120 ] || fail "the refused worker step took ${elapsed}s to fail the job"
grep -q "the worker step ended" "$dir"/gpu-*.out || fail "no fail-fast message"
echo "ok: a refused worker step fails the batch job in ${elapsed}s"
echo PASS
