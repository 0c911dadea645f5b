#!/usr/bin/env bash
# End-to-end control-plane overhead: the same 2-rank job run by `vocabpipe run` (the local
# launcher, no daemons) and through vocabpipe-coordinator + two vocabpipe-worker daemons.
# Both execute the same rank processes; the difference in median step time is what the
# control plane (heartbeats, metric reports, gRPC store rendezvous) costs.
#   bench/control/overhead.sh BUILD_DIR [STEPS]
set -euo pipefail
build=${1:?usage: overhead.sh BUILD_DIR [STEPS]}
steps=${2:-12}
build=$(cd "$build" && pwd)
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
cd "$work"
"$build/client/vocabpipe" data synth --vocab 8192 --tokens 200000 --out data.bin > /dev/null
spec() {  # NAME
  cat > "$1.yaml" <<YAML
name: $1
model: {layers: 4, hidden: 256, heads: 4, vocab_size: 8192, seq_len: 128}
parallel: {pipeline: 2, microbatch_size: 2, microbatches: 4, schedule: 1f1b, vocab: vocab2}
train: {steps: $steps, threads: 1}
data: {path: data.bin}
checkpoint: {dir: $1}
YAML
}
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

spec local
"$build/client/vocabpipe" run local.yaml > /dev/null
# Skip the first step (warm-up) in both.
local_s=$(python3 -c 'import json,sys
for l in list(open("local/metrics.jsonl"))[1:]: print(json.loads(l)["step_seconds"])' | median)

spec daemon
"$build/coordinator/server/vocabpipe-coordinator" --listen 127.0.0.1:0 --db c.db --no-profile \
  > coord.log 2>&1 &
for _ in $(seq 50); do grep -q listening coord.log && break; sleep 0.1; done
addr=$(grep -o '127.0.0.1:[0-9]*' coord.log)
"$build/worker/launch/vocabpipe-worker" --coordinator "$addr" > w0.log 2>&1 &
"$build/worker/launch/vocabpipe-worker" --coordinator "$addr" > w1.log 2>&1 &
id=$("$build/client/vocabpipe" submit daemon.yaml --coordinator "$addr")
"$build/client/vocabpipe" watch "$id" --coordinator "$addr" --output json > events.jsonl
daemon_s=$(python3 -c 'import json
ev=[json.loads(l) for l in open("events.jsonl")]
for e in [e for e in ev if "step" in e][1:]: print(e["step"]["seconds"])' | median)
python3 - "$local_s" "$daemon_s" <<'PY'
import sys
local, daemon = map(float, sys.argv[1:])
print(f"median step: local launcher {local*1e3:.1f} ms, control plane {daemon*1e3:.1f} ms, "
      f"overhead {100*(daemon-local)/local:+.2f}%")
PY
