#!/usr/bin/env bash
# make demo-text: a small GPT-2 trained on real English text on this machine's CPU. The King
# James Bible from Debian's bible-kjv package → a SentencePiece BPE tokenizer → llm.c shards
# with a train/val split → examples/demo-text.yaml on 2 pipeline ranks (Vocab-1) through the
# control plane, with validation loss and samples. Ends with train and validation loss against
# the corpus's unigram entropy, the loss curve (SVG) and samples before and after training.
set -euo pipefail
BUILD_DIR=${1:-build}
cd "$(dirname "$0")/.."
VP="$BUILD_DIR/client/vocabpipe"
SPEC=examples/demo-text.yaml
TEXT=examples/text
DATA=$TEXT/kjv
RUN=examples/runs/demo-text
PROMPT="And God said"
start=$(date +%s)

command -v bible >/dev/null || {
  echo "demo-text needs the bible-kjv package (make deps installs it: scripts/setup.sh)" >&2
  exit 1
}
mkdir -p "$TEXT"

echo "== 1. corpus: the King James Bible (Debian package bible-kjv)"
[ -s "$TEXT/kjv.txt" ] || bible "Gen1:1-Rev22:21" > "$TEXT/kjv.txt"
echo "$TEXT/kjv.txt: $(wc -c < "$TEXT/kjv.txt") bytes, $(wc -w < "$TEXT/kjv.txt") words"

echo
echo "== 2. tokenizer: SentencePiece BPE, 4096 tokens, trained on the corpus"
"$VP" data train-tokenizer "$TEXT/kjv.txt" --vocab-size 4096 --out "$TEXT/kjv.model"

echo
echo "== 3. tokens: llm.c shards, 5% of the chapters (evenly spread) held out for validation"
rm -rf "$DATA"
"$VP" data tokenize --tokenizer "$TEXT/kjv.model" "$TEXT/kjv.txt" --out "$DATA" \
  --val-fraction 0.05
entropy=$(/usr/bin/python3 - "$DATA/kjv_train_000000.bin" "$DATA/kjv_val_000000.bin" <<'PY'
import math, sys
import numpy as np
def tokens(path):
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(1024), dtype="<i4")
        return np.frombuffer(f.read(), dtype="<u2")[: int(header[2])]
train, val = tokens(sys.argv[1]), tokens(sys.argv[2])
# The unigram model of the training split (add-one smoothed over the 4096 tokens), scored on
# the validation split: the loss of a model that ignores context.
counts = np.bincount(train, minlength=4096).astype(np.float64) + 1.0
logp = np.log(counts / counts.sum())
print(f"{-logp[val].mean():.4f}")
PY
)
echo "unigram entropy of the corpus: $entropy nats/token (a context-free model's validation loss)"

echo
echo "== 4. sample before training (the initial weights: steps 0 saves them)"
rm -rf "$RUN" "$RUN.init"
init_spec=$(mktemp --suffix=.yaml -p examples)
sed -e 's/steps: 800/steps: 0/' -e "s#dir: runs/demo-text#dir: runs/demo-text.init#" \
  -e 's/sample_every: 400/sample_every: 0/' "$SPEC" > "$init_spec"
"$VP" run "$init_spec" > /dev/null 2>&1 || { rm -f "$init_spec"; "$VP" run "$SPEC"; exit 1; }
rm -f "$init_spec"
echo "prompt: \"$PROMPT\""
before=$("$VP" sample "$RUN.init/step_0" --prompt "$PROMPT" --max-tokens 48 --temperature 1 \
  --top-k 40 --seed 7)
echo "$before"

echo
echo "== 5. training: 2 pipeline ranks (Vocab-1), validation every 100 steps, a sample every 400"
log=$(mktemp)
"$VP" run "$SPEC" > "$log" 2>&1 || { cat "$log"; rm -f "$log"; exit 1; }
# The evaluated steps' progress lines, the samples drawn during training and the summary.
awk '/^step [0-9]+\/[0-9]+ .*\| val /{print} /^sample after step/{p=1} p{print} /^---$/{p=0}
     /^done:/{print}' "$log"
rm -f "$log"

echo
echo "== 6. sample after training"
echo "prompt: \"$PROMPT\""
after=$("$VP" sample "$RUN" --prompt "$PROMPT" --max-tokens 48 --temperature 1 --top-k 40 --seed 7)
echo "$after"

echo
echo "== report (from $RUN/metrics.jsonl)"
# The loss curve (matplotlib: Debian's python3-matplotlib, which `make deps` installs).
/usr/bin/python3 scripts/demo_text_chart.py "$RUN" "$entropy" "$RUN.loss.svg"
/usr/bin/python3 - "$RUN" "$entropy" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
run, entropy, seconds = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
lines = [json.loads(l) for l in open(run + "/metrics.jsonl")]
train = [l["loss"] for l in lines]
val = [(l["step"] + 1, l["val_loss"]) for l in lines if "val_loss" in l]
last = sum(train[-50:]) / min(50, len(train))
print(f"train loss {train[0]:.3f} -> {last:.3f} (mean of the last 50 steps)")
print(f"validation loss {val[0][1]:.3f} (step {val[0][0]}) -> {val[-1][1]:.3f} (step {val[-1][0]})")
print(f"unigram entropy {entropy:.3f} nats/token: the validation loss is "
      f"{entropy - val[-1][1]:.3f} nats below it")
timed = lines[1:]
tokens = sum(l["tokens_per_s"] * l["step_seconds"] for l in timed)
print(f"throughput {tokens / sum(l['step_seconds'] for l in timed):,.0f} tokens/s; "
      f"demo wall time {seconds // 60} min {seconds % 60} s")

print(f"loss curve: {run}.loss.svg")
if not val[-1][1] < entropy - 1.0:
    print("FAIL: the validation loss did not fall well below the unigram entropy")
    sys.exit(1)
PY
