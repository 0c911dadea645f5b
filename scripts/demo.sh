#!/usr/bin/env bash
# make demo: a vocabulary-parallel job on 2 pipeline ranks, run through the control plane (the
# default of `vocabpipe run`: an in-process coordinator and one worker daemon per rank over
# gRPC on loopback), on synthetic data with a known loss floor; ends with a report.
set -euo pipefail
BUILD_DIR=${1:-build}
cd "$(dirname "$0")/.."
VP="$BUILD_DIR/client/vocabpipe"
SPEC=examples/demo-p2.yaml
RUN=examples/runs/demo-p2

echo "== 1. synthetic corpus: a random sparse Markov chain over 1000 tokens"
synth=$("$VP" data synth --vocab 1000 --tokens 400000 --out examples/data.bin --seed 1)
echo "$synth"
floor=$(echo "$synth" | sed -n 's/.*entropy rate \([0-9.]*\).*/\1/p')

echo
echo "== 2. the pass plan: 1F1B with Vocab-2 on 2 ranks (checked and simulated offline)"
"$VP" plan "$SPEC" --format table
rm -rf "$RUN"
mkdir -p "$RUN"
"$VP" plan "$SPEC" --format svg > "$RUN.plan.svg"
echo "timeline picture: $RUN.plan.svg"

echo
echo "== 3. training: vocabpipe run starts an in-process coordinator and 2 worker daemons;"
echo "   the daemons register, profile the passes, get the plan and run the ranks over gRPC"
log=$(mktemp)
"$VP" run "$SPEC" > "$log" 2>&1 || { cat "$log"; exit 1; }
grep '^job-' "$log"
tail -n 3 "$log"
mfu=$(sed -n 's/^done: .*MFU \([0-9.]*%\).*/\1/p' "$log")
rm -f "$log"

echo
echo "== report (from $RUN/metrics.jsonl)"
/usr/bin/python3 - "$RUN" "$floor" "$mfu" <<'PY'
import json, sys
run, floor, mfu = sys.argv[1], float(sys.argv[2]), sys.argv[3]
lines = [json.loads(l) for l in open(run + "/metrics.jsonl")]
losses = [l["loss"] for l in lines]
last = sum(losses[-20:]) / min(20, len(losses))
print(f"loss {losses[0]:.3f} -> {last:.3f} (mean of the last 20 steps); "
      f"entropy floor {floor:.3f} nats/token; closed {100 * (losses[0] - last) / (losses[0] - floor):.0f}% of the gap")
timed = lines[1:]
tokens = sum(l["tokens_per_s"] * l["step_seconds"] for l in timed)
print(f"throughput {tokens / sum(l['step_seconds'] for l in timed):,.0f} tokens/s, "
      f"MFU {mfu} of the measured sgemm peak per rank")
p = len(lines[0]["stages"])
busy = [sum(l["stages"][r]["busy_seconds"] for l in timed) for r in range(p)]
print(f"busy-time balance max/mean {max(busy) / (sum(busy) / p):.3f} "
      "(each rank holds half of the embedding and half of the output layer)")
for r in range(p):
    s = lines[-1]["stages"][r]
    m = s["memory"]
    print(f"  rank {r}: busy {busy[r]:.2f} s, peak memory {m['total'] / 2**20:.2f} MiB "
          f"(planner predicted {s['predicted_memory_total'] / 2**20:.2f}; parameters "
          f"{m['parameters'] / 2**20:.2f}, gradients {m['gradients'] / 2**20:.2f}, "
          f"optimizer {m['optimizer'] / 2**20:.2f}, activations {m['activations'] / 2**20:.2f})")
print(f"plan timeline: {run}.plan.svg; job record: {run}/coordinator.db "
      f"(vocabpipe-coordinator --db reads it)")
PY

echo
echo "== the run's report (loss, tokens/s, busy and memory beside the planner's prediction)"
"$VP" report "$RUN"
