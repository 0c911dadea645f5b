#!/usr/bin/env bash
# Every query of the Grafana dashboard (deploy/grafana/dashboards/vocabpipe.json) returns data
# from a real Prometheus (Debian's /usr/bin/prometheus) scraping a real coordinator while a real
# job of two data-parallel replicas of a p=2 pipeline runs on four worker daemons. The dashboard's variables are set as Grafana sets them
# for "All": $training_job and $stage = .*, $__rate_interval = 1m.
# Usage: dashboard_queries_test.sh BUILD_DIR. Exits 77 (skipped) without prometheus.
set -euo pipefail
build="$(cd "${1:?usage: dashboard_queries_test.sh BUILD_DIR}" && pwd)"
src="$(cd "$(dirname "$0")/../.." && pwd)"
command -v prometheus >/dev/null || { echo "SKIP: prometheus not installed"; exit 77; }
dir="$(mktemp -d /tmp/vocabpipe-dash.XXXXXX)"
pids=()
cleanup() {
  set +e
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
  if [ "${keep:-0}" = 1 ]; then echo "logs kept in $dir"; else rm -rf "$dir"; fi
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; keep=1; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

vp="$build/client/vocabpipe"
mport="$(free_port)"
"$build/coordinator/server/vocabpipe-coordinator" --listen 127.0.0.1:0 --db "$dir/c.db" --insecure \
  --metrics-listen "127.0.0.1:$mport" --heartbeat-interval 0.2 > "$dir/coordinator.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do grep -q "listening on 127.0.0.1:" "$dir/coordinator.log" && break; sleep 0.1; done
coord="127.0.0.1:$(sed -n 's/.*listening on 127.0.0.1:\([0-9]*\).*/\1/p' "$dir/coordinator.log" | head -n 1)"
for i in 0 1 2 3; do
  "$build/worker/main/vocabpipe-worker" --coordinator "$coord" --insecure --rank-hint "$i" > "$dir/w$i.log" 2>&1 &
  pids+=($!)
done

pport="$(free_port)"
cat > "$dir/prometheus.yml" <<YAML
global: {scrape_interval: 1s, evaluation_interval: 1s}
scrape_configs:
  - job_name: vocabpipe
    static_configs: [{targets: ["127.0.0.1:$mport"]}]
YAML
prometheus --config.file="$dir/prometheus.yml" --storage.tsdb.path="$dir/tsdb" \
  --web.listen-address="127.0.0.1:$pport" > "$dir/prometheus.log" 2>&1 &
pids+=($!)

"$vp" data synth --vocab 64 --tokens 20000 --seed 5 --out "$dir/data.bin" >/dev/null
"$vp" data synth --vocab 64 --tokens 4000 --seed 6 --out "$dir/val.bin" >/dev/null
cat > "$dir/job.yaml" <<YAML
name: dash
model: {layers: 2, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16}
parallel: {pipeline: 2, data: 2, microbatch_size: 2, microbatches: 4}
train: {steps: 400, lr: 0.003, threads: 1, eval_every: 100, eval_batches: 4}
data: {path: $dir/data.bin, val_path: $dir/val.bin}
checkpoint: {dir: $dir/ckpt, every: 0}
YAML
job="$("$vp" submit "$dir/job.yaml" --coordinator "$coord" --insecure)"
"$vp" watch "$job" --coordinator "$coord" --insecure > "$dir/watch.log" 2>&1 || fail "job $job did not succeed"
sleep 3  # a last scrape after the end

python3 - "$src/deploy/grafana/dashboards/vocabpipe.json" "$pport" <<'PY' || fail "dashboard queries"
import json, sys, urllib.parse, urllib.request
dash, port = sys.argv[1], sys.argv[2]
exprs = []
def walk(o):
    if isinstance(o, dict):
        if "expr" in o:
            exprs.append(o["expr"])
        for v in o.values():
            walk(v)
    elif isinstance(o, list):
        for v in o:
            walk(v)
walk(json.load(open(dash))["panels"])
assert len(exprs) >= 25, f"only {len(exprs)} queries found"
empty = []
for e in exprs:
    q = e.replace("$training_job", ".*").replace("$stage", ".*").replace("$__rate_interval", "1m")
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    r = json.load(urllib.request.urlopen(url, timeout=10))
    assert r["status"] == "success", (e, r)
    if not r["data"]["result"]:
        empty.append(e)
# Every rank's series carry its stage and replica: both replicas of both stages are there.
q = 'count by (stage, replica) (vocabpipe_stage_busy_ratio)'
r = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?" +
                                     urllib.parse.urlencode({"query": q}), timeout=10))
pairs = sorted((m["metric"]["stage"], m["metric"]["replica"]) for m in r["data"]["result"])
assert pairs == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")], pairs
for e in empty:
    print("no data:", e)
print(f"{len(exprs) - len(empty)} of {len(exprs)} dashboard queries return data")
sys.exit(1 if empty else 0)
PY
echo PASS
