#!/usr/bin/env bash
# data_bench.sh: a rank's resident memory, the loader's rate and the first microbatch on a cold
# page cache, for a 10M-token corpus (one shard) and a 1B-token corpus (10 shards of 100M, 2 GB
# on disk), written here and deleted after (docs/benchmarks.md §11).
#
#   bash bench/data/data_bench.sh [BUILD_DIR] [WORKDIR]     (default build, a fresh temp folder)
#
# For each corpus:
#   - data_loader_bench: tokens/s the sample reader delivers (sequential, shuffled; s = 1024,
#     b = 8), process RSS, first microbatch and first 100 on a cold page cache;
#   - `vocabpipe run --direct` of a small GPT-2 (p = 1, 20 steps, shuffled): the process's
#     resident memory sampled from outside every 10 ms while it trains (VmRSS, as
#     CliRunTest.ResidentMemoryDoesNotGrowWithTheCorpus does), the peak the run reports, and the
#     tokens/s it consumes.
set -euo pipefail
BUILD=${1:-build}
WORK=${2:-$(mktemp -d "${TMPDIR:-/tmp}/vp-data-bench.XXXXXX")}
VP=$BUILD/client/vocabpipe
LOADER=$BUILD/bench/data/data_loader_bench
mkdir -p "$WORK"
trap 'rm -rf "$WORK"' EXIT

corpus() {  # NAME SHARDS TOKENS_PER_SHARD
  mkdir -p "$WORK/$1"
  for ((i = 0; i < $2; i++)); do
    "$VP" data synth --vocab 50257 --tokens "$3" --seed $((i + 1)) \
      --out "$WORK/$1/$1_train_$(printf %06d "$i").bin" > /dev/null
  done
  echo "corpus $1: $2 shard(s) of $3 tokens, $(du -sh "$WORK/$1" | cut -f1) on disk"
}

train() {  # NAME: prints peak sampled RSS, reported peak, tokens/s
  cat > "$WORK/$1.yaml" << EOF
model: {layers: 4, hidden: 256, heads: 4, vocab_size: 50257, seq_len: 256}
parallel: {microbatch_size: 4, microbatches: 4}
train: {steps: 20, threads: 2}
data: {path: $1, shuffle: true}
checkpoint: {dir: $1-run}
EOF
  python3 - "$VP" "$WORK/$1.yaml" "$WORK/$1-run/metrics.jsonl" << 'PY'
import json, os, subprocess, sys, time
vp, spec, metrics = sys.argv[1:4]
p = subprocess.Popen([vp, "run", "--direct", spec], stdout=subprocess.DEVNULL,
                     stderr=subprocess.STDOUT)
peak = 0
def lines():
    try:
        with open(metrics) as f:
            return sum(1 for _ in f)
    except OSError:
        return 0
while p.poll() is None and lines() < 20:
    try:
        with open(f"/proc/{p.pid}/status") as f:
            for l in f:
                if l.startswith("VmRSS:"):
                    peak = max(peak, int(l.split()[1]) * 1024)
    except OSError:
        pass
    time.sleep(0.01)
p.wait()
rows = [json.loads(l) for l in open(metrics)]
tps = sorted(r["tokens_per_s"] for r in rows[1:])[len(rows[1:]) // 2]
print(f"  training: RSS measured from outside {peak / 2**20:.1f} MiB, reported peak "
      f"{max(r['peak_memory_bytes'] for r in rows) / 2**20:.1f} MiB, median {tps:,.0f} tokens/s "
      f"consumed (exit {p.returncode})")
PY
}

for spec in "small 1 10000000" "large 10 100000000"; do
  read -r name shards tokens <<< "$spec"
  corpus "$name" "$shards" "$tokens"
  "$LOADER" --data "$WORK/$name" --seconds 5 --cold | sed 's/^/  loader: /'
  train "$name"
  rm -rf "${WORK:?}/$name" "$WORK/$name-run"
done
