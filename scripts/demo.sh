#!/usr/bin/env bash
# make demo: synthetic data, the plan of a vocabulary-parallel pipeline, then a standalone
# training run whose loss approaches the data's entropy floor.
set -euo pipefail
BUILD_DIR=${1:-build}
cd "$(dirname "$0")/.."
VP="$BUILD_DIR/client/vocabpipe"
STEPS=${DEMO_STEPS:-1500}

echo "== 1. synthetic corpus: a random sparse Markov chain over 1000 tokens"
synth=$("$VP" data synth --vocab 1000 --tokens 400000 --out examples/data.bin --seed 1)
echo "$synth"
floor=$(echo "$synth" | sed -n 's/.*entropy rate \([0-9.]*\).*/\1/p')

echo
echo "== 2. the pass plan of the same model on 2 pipeline ranks with Vocab-2 (planner, offline)"
"$VP" plan examples/vocab2-p2.yaml --format table | head -n 30
mkdir -p runs/demo
"$VP" plan examples/vocab2-p2.yaml --format svg > runs/demo/plan.svg
echo "timeline picture: runs/demo/plan.svg"

echo
echo "== 3. training examples/demo.yaml for $STEPS steps on this machine"
"$VP" run examples/demo.yaml --steps "$STEPS"

echo
echo "== report"
metrics=examples/runs/demo/metrics.jsonl
/usr/bin/python3 - "$metrics" "$floor" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
floor = float(sys.argv[2])
first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-20:]) / min(20, len(rows))
timed = rows[1:] or rows
seconds = sum(r["step_seconds"] for r in timed)
tps = sum(r["tokens_per_s"] * r["step_seconds"] for r in timed) / seconds
mfu = sum(r["mfu"] * r["step_seconds"] for r in timed) / seconds
mem = rows[-1]["memory"]
print(f"loss {first:.3f} -> {last:.3f} (mean of the last 20 steps); entropy floor {floor:.3f} nats/token")
print(f"closed {100 * (first - last) / (first - floor):.0f}% of the gap to the floor")
print(f"throughput {tps:,.0f} tokens/s, MFU {100 * mfu:.1f}% of the measured sgemm peak")
print("memory: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in mem.items()))
PY
