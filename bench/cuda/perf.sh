#!/usr/bin/env bash
# perf.sh: issue 28's GPU performance measurement in one short command: cuda_bench (measured
# bf16 GEMM peak, transformer layer F and B+W MFU, output layer S+T MFU, a whole p = 1 training
# step's tokens/s, MFU and peak in-use/reserved memory) and torch_baseline.py (the same models
# and batches in PyTorch eager bf16) for three models, then one table; then the same models
# under each variant (environment switches, PERF_VARIANTS) as extra table rows, and the
# per-phase breakdown of every model and variant (cuda_bench's BREAKDOWN lines).
#
#   bench/cuda/perf.sh OUTDIR [--quick]     on the GPU host (about 70-90 s on an H100, < 135 s
#                                           by construction: see the budget below)
#   bench/cuda/perf.sh --dry-run OUTDIR     anywhere: checks that everything is present, runs
#                                           the device-free parts, prints what it would run
#   bench/cuda/perf.sh --table OUTDIR       anywhere: prints the table again from the logs an
#                                           earlier run left in OUTDIR (rewrites perf.txt)
#
# Models (torch_baseline.py MODELS; cuda_bench gets its flags from there): 8 layers, s = 2048,
# 8192 tokens per step, untied embeddings, fp32 master weights + AdamW, bf16 compute:
#   gpt2-50k   h 2048, 16 heads, ffn 8192, V 50304,   m 2 x b 2   0.61B parameters
#   gpt2-256k  h 2048, 16 heads, ffn 8192, V 256000,  m 2 x b 2   1.46B parameters
#   llama      h 4096, 32 heads, 8 KV heads, SwiGLU 14336, RMSNorm, RoPE, V 128256,
#              m 4 x b 1                                            2.80B parameters
# Memory on an 80 GB H100 (GiB = 2^30 bytes; state = what is held from the start):
#   vocabpipe: 19 bytes/parameter (fp32 master 4, bf16 copy 2, fp32 grads 4, Adam m, v 8, decay
#     mask 1): 10.8 / 25.8 / 49.5 GiB; plus one microbatch's activations (at p = 1 each
#     microbatch's forward is followed by its backward, so m adds nothing): about 1-2 GiB for
#     GPT-2 b = 2 (~34·b·s·h bytes per layer) and 2-3 GiB for Llama b = 1 (~130 KB per token
#     per layer), plus the bf16 logits n·V·2 bytes (0.4 / 2.0 / 0.5 GiB) and a backward's
#     working set: peaks of about 13 / 30 / 54 GiB, at least 25 GiB below 80.
#   PyTorch eager: 16 bytes/parameter (fp32 weights, grads, m, v) = 9.1 / 21.7 / 41.7 GiB, plus
#     autocast's bf16 weight copies (2 bytes/parameter), fp32 residual-stream activations
#     (~3 / 3 / 4.5 GiB) and the fp32 logits, log-softmax and their gradients (~4·n·V·4 bytes:
#     3 / 16 / 4 GiB): peaks of about 17 / 43 / 56 GiB. (b = 2 for Llama would add ~8 GiB to
#     torch's peak; b = 1, m = 4 keeps it near 60 with the same tokens.)
#
# Budget: the whole script stops within PERF_BUDGET_S (165) seconds: every program runs under
# `timeout`, given min(its cap, what is left of the budget), and 30 s stay reserved for the
# torch run until it has run; the variants run last, in what is left. A program that fails or
# times out prints FAIL with its first error line; the script goes on and the table shows what
# was measured.
#
# Variants: PERF_VARIANTS, space-separated NAME:VAR=VALUE[,VAR=VALUE...] entries ("" for none);
# by default, in this order (the budget cuts the last first): cudnn (VOCABPIPE_ATTENTION=cudnn:
# cuDNN's fused attention through its graph API, the library kernels PyTorch's SDPA uses on
# Hopper), cudnn-all (cudnn, vector and epilogues), pipelined (VOCABPIPE_ATTENTION=
# flash-pipelined: the flash kernels with cp.async double buffering and ldmatrix operands), wide
# (VOCABPIPE_ATTENTION=flash-wide: the pipelined backward and a forward of 32 query rows per
# warp), vector (VOCABPIPE_MEMORY_KERNELS=vector: 16-byte norm, GELU, SwiGLU, residual, bias,
# output-layer softmax and AdamW kernels), epilogues (VOCABPIPE_GEMM_EPILOGUE=all: the linear
# layers' bias, GPT-2's GELU and its gradient in the cuBLASLt epilogues, and the residual stream
# read as the C matrix of the GEMMs that write it; the bias epilogue's own gain runs 3 and 4
# measured) and all (wide, vector and epilogues); about 15 s a variant for the three models. Each
# runs cuda_bench's layer, output, attention and step sections for every model with those
# variables set (the peak measured above), as the table row MODEL+NAME. An entry of another form,
# or one that sets a VOCABPIPE_ variable no kernel reads (a misspelt switch would time the
# defaults under the variant's name), is reported FAIL and skipped before anything runs; a dry
# run then exits 1. cuda_bench refuses a switch's unknown value itself.
#
# Environment:
#   VP_BIN_ENV               prefix for our binaries, e.g. "env LD_LIBRARY_PATH=/x/lib" (split
#                            on spaces); python3 never gets it.
#   VP_HOST_LD_LIBRARY_PATH  if set, python3 runs with LD_LIBRARY_PATH set to it (unset when
#                            empty) instead of the inherited one.
#   CUDA_BENCH               the cuda_bench binary (default: beside this script, as in the GPU
#                            bundle's bench/, else build-cuda/ or build/ of the source tree).
#   PYTHON (python3), PERF_BUDGET_S (165), PERF_VARIANTS (above).
# Output: OUTDIR/perf.txt (the table and the breakdowns, also on stdout),
# OUTDIR/cuda_bench-MODEL.log, OUTDIR/cuda_bench-MODEL+VARIANT.log, OUTDIR/torch.log.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=bench/cuda/bench_common.sh
. "$here/bench_common.sh"
table_only=0
if [[ "${1:-}" == --table ]]; then
  table_only=1
  shift
fi
parse_bench_options perf.sh \
  "perf.sh OUTDIR [--quick] | perf.sh --dry-run OUTDIR | perf.sh --table OUTDIR" 1 "$@"

budget=${PERF_BUDGET_S:-165}
default_variants="cudnn:VOCABPIPE_ATTENTION=cudnn"
default_variants+=" cudnn-all:VOCABPIPE_ATTENTION=cudnn,VOCABPIPE_MEMORY_KERNELS=vector"
default_variants+=",VOCABPIPE_GEMM_EPILOGUE=all"
default_variants+=" pipelined:VOCABPIPE_ATTENTION=flash-pipelined"
default_variants+=" wide:VOCABPIPE_ATTENTION=flash-wide"
default_variants+=" vector:VOCABPIPE_MEMORY_KERNELS=vector"
default_variants+=" epilogues:VOCABPIPE_GEMM_EPILOGUE=all"
default_variants+=" all:VOCABPIPE_ATTENTION=flash-wide,VOCABPIPE_MEMORY_KERNELS=vector"
default_variants+=",VOCABPIPE_GEMM_EPILOGUE=all"
read -r -a variants <<< "${PERF_VARIANTS-$default_variants}"

# Why a PERF_VARIANTS entry cannot run ("" when it can): NAME:VAR=VALUE[,VAR=VALUE...], and a
# VOCABPIPE_ variable only among the kernel switches cuda_bench reads — a misspelt one would time
# the default kernels under the variant's name (cuda_bench itself refuses an unknown value).
variant_problem() {
  local v=$1 a parts
  [[ "$v" == ?*:*=* ]] || {
    echo "is not NAME:VAR=VALUE[,VAR=VALUE]"
    return
  }
  IFS=, read -r -a parts <<< "${v#*:}"
  for a in "${parts[@]}"; do
    [[ "$a" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || {
      echo "has '$a', not VAR=VALUE"
      return
    }
    case "${a%%=*}" in
      VOCABPIPE_ATTENTION | VOCABPIPE_MEMORY_KERNELS | VOCABPIPE_GEMM_EPILOGUE) ;;
      VOCABPIPE_*)
        echo "sets ${a%%=*}, which no kernel reads (the switches:" \
          "VOCABPIPE_ATTENTION, VOCABPIPE_MEMORY_KERNELS, VOCABPIPE_GEMM_EPILOGUE)"
        return
        ;;
    esac
  done
}
# Checked before anything runs: a bad entry is reported and dropped (the others still run); a
# dry run then fails.
if ((!table_only)); then
  bad_variants=0
  good=()
  for v in "${variants[@]}"; do
    problem=$(variant_problem "$v")
    if [[ -n "$problem" ]]; then
      echo "FAIL: PERF_VARIANTS entry '$v' $problem"
      bad_variants=1
    else
      good+=("$v")
    fi
  done
  variants=("${good[@]}")
  ((!dry_run || !bad_variants)) || exit 1
fi
t_start=$SECONDS
models=(gpt2-50k gpt2-256k llama)
bench_programs "$here"
baseline=$here/torch_baseline.py
if ((quick)); then
  warmup=1 iters=2 sections=peak,layer,output,step
else
  warmup=2 iters=3 sections=peak,layer,output,gemm,attention,memory,step
fi

missing=0
((table_only)) || [[ -n "$bench" && -x "$bench" ]] || {
  echo "perf.sh: cuda_bench not found (beside perf.sh, build-cuda/, build/ or \$CUDA_BENCH)" >&2
  missing=1
}
[[ -f "$baseline" ]] || {
  echo "perf.sh: $baseline not found" >&2
  missing=1
}
command -v "$python" > /dev/null || {
  echo "perf.sh: $python not found" >&2
  missing=1
}
((missing == 0)) || exit 1

# The first line of a log that looks like an error, else its last line.
first_error() {
  local line
  line=$(grep -m1 -E 'FAIL|[Ee]rror:|what\(\)|terminate|Aborted|Killed|Segmentation' "$1")
  [[ -n "$line" ]] || line=$(tail -n 1 "$1")
  echo "${line:0:200}"
}

# run NAME CAP LOG CMD...: CMD under timeout with min(CAP, budget left - reserve) seconds.
reserve=30  # for the torch run, until it has run
run() {
  local name=$1 cap=$2 log=$3
  shift 3
  # 3 s for timeout's -k 2 and the start-up around it.
  local left=$((budget - (SECONDS - t_start) - reserve - 3))
  local limit=$((cap < left ? cap : left))
  if ((limit < 5)); then
    echo "== $name: SKIP (budget: ${left}s left)" | tee "$log"
    return 1
  fi
  echo "== $name (timeout ${limit}s): $*" > "$log"
  local t0=$SECONDS rc
  timeout -k 2 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  if ((rc == 0)); then
    echo "== $name: ok in $((SECONDS - t0))s"
  elif ((rc == 124 || rc == 137)); then
    echo "== $name: FAIL timeout after ${limit}s; $(first_error "$log")"
  else
    echo "== $name: FAIL rc=$rc; $(first_error "$log")"
  fi
  return $rc
}

# kv FILE TAG KEY: KEY's value on the first line starting with TAG ("PERF section=step", ...).
kv() {
  awk -v tag="$2" -v key="$3" 'index($0, tag) == 1 {
      for (i = 1; i <= NF; ++i) if (index($i, key "=") == 1) { print substr($i, length(key) + 2); exit }
    }' "$1" 2> /dev/null
}

flags_of() { "${py_env[@]}" "$python" "$baseline" --cuda-bench-flags "$1"; }

if ((dry_run)); then
  echo "perf.sh --dry-run: cuda_bench $bench"
  echo "perf.sh --dry-run: torch_baseline $baseline (python: ${py_env[*]} $python)"
  echo "perf.sh --dry-run: our binaries run with prefix: ${bin_env[*]:-(none)}"
  status=0
  for m in "${models[@]}"; do
    flags=$(flags_of "$m") || {
      echo "FAIL: torch_baseline.py --cuda-bench-flags $m"
      status=1
      continue
    }
    # shellcheck disable=SC2086  # flags are words
    vp=$("${bin_env[@]}" "$bench" --print-flops $flags 2>&1) || {
      echo "FAIL: cuda_bench --print-flops $flags: $vp"
      status=1
      continue
    }
    py=$("${py_env[@]}" "$python" "$baseline" --print-flops --models "$m")
    echo "  $m: cuda_bench $vp"
    echo "  $m: torch_baseline $py"
    [[ "$(kv <(echo "$vp") FLOPS step)" == "$(kv <(echo "$py") FLOPS step)" ]] || {
      echo "FAIL: $m: the two programs count different step FLOPs"
      status=1
    }
    echo "  would run: timeout ... ${bin_env[*]} $bench --sections=$sections --algorithm=2" \
      "--warmup=$warmup --iters=$iters $flags [--peak=<measured> after the first model]"
  done
  for v in "${variants[@]}"; do
    echo "  would run variant ${v%%:*}: env ${v#*:} (commas: separate variables) ... $bench" \
      "--sections=layer,output,attention,step ... for ${models[*]}"
  done
  echo "  would run: timeout ... ${py_env[*]} $python $baseline --models $(
    IFS=,
    echo "${models[*]}"
  ) --warmup $warmup --iters $iters --peak-tflops <measured>"
  dev=$("${bin_env[@]}" "$bench" --sections=peak --peak-size=64 2>&1 | head -n 1)
  echo "perf.sh --dry-run: cuda_bench on this machine: $dev"
  if "${py_env[@]}" "$python" -c 'import torch.cuda' 2> /dev/null; then
    echo "perf.sh --dry-run: torch importable here"
  else
    echo "perf.sh --dry-run: torch not importable here (needed on the GPU host only)"
  fi
  exit $status
fi

if ((table_only)); then
  # The rows and the peak an earlier run's logs hold: its variants are the NAMEs of its
  # cuda_bench-MODEL+NAME.log files, whatever PERF_VARIANTS says now.
  peak=$(kv "$outdir/cuda_bench-${models[0]}.log" "PERF section=peak" peak_tflops)
  rows=("${models[@]}")
  variants=()
  for f in "$outdir"/cuda_bench-*+*.log; do
    [[ -f "$f" ]] || continue
    name=${f##*+}
    name=${name%.log}
    [[ " ${variants[*]} " == *" $name "* ]] || variants+=("$name")
  done
  for name in "${variants[@]}"; do
    for m in "${models[@]}"; do
      [[ -f "$outdir/cuda_bench-$m+$name.log" ]] && rows+=("$m+$name")
    done
  done
else
  echo "perf.sh: logs in $outdir; budget ${budget}s; warm-up $warmup, timed $iters"
  peak=""
  caps=(25 25 32)
  for i in "${!models[@]}"; do
    m=${models[$i]}
    flags=$(flags_of "$m")
    secs=$sections
    extra=()
    if [[ -n "$peak" ]]; then
      secs=${sections/peak,/}
      extra=(--peak="$peak")
    fi
    # shellcheck disable=SC2086  # flags are words
    run "cuda_bench $m" "${caps[$i]}" "$outdir/cuda_bench-$m.log" "${bin_env[@]}" "$bench" \
      --sections="$secs" --algorithm=2 --warmup=$warmup --iters=$iters $flags "${extra[@]}"
    if [[ -z "$peak" ]]; then
      peak=$(kv "$outdir/cuda_bench-$m.log" "PERF section=peak" peak_tflops)
    fi
  done
  reserve=0
  peak_args=()
  [[ -n "$peak" ]] && peak_args=(--peak-tflops "$peak")
  run "torch eager (all models)" 80 "$outdir/torch.log" "${py_env[@]}" "$python" "$baseline" \
    --models "$(
      IFS=,
      echo "${models[*]}"
    )" --warmup $warmup --iters $iters "${peak_args[@]}"

  # The variants, in what is left of the budget (each model's row MODEL+NAME).
  rows=("${models[@]}")
  for v in "${variants[@]}"; do
    name=${v%%:*}
    IFS=, read -r -a assigns <<< "${v#*:}"
    # cuDNN plans each shape at its first call (compiling kernels): twice the time.
    cap=25
    [[ "$v" == *=cudnn* ]] && cap=50
    for m in "${models[@]}"; do
      flags=$(flags_of "$m")
      extra=()
      [[ -n "$peak" ]] && extra=(--peak="$peak")
      # shellcheck disable=SC2086  # flags are words
      run "cuda_bench $m+$name" $cap "$outdir/cuda_bench-$m+$name.log" env "${assigns[@]}" \
        "${bin_env[@]}" "$bench" --sections=layer,output,attention,step --warmup=$warmup \
        --iters=$iters $flags "${extra[@]}"
      rows+=("$m+$name")
    done
  done
fi

# The table.
pct() { [[ -n "$1" && "$1" != n/a ]] && echo "$1%" || echo "-"; }
or_dash() { [[ -n "$1" ]] && echo "$1" || echo "-"; }
# mark VALUE LIMIT ge|le: "+" when VALUE >= (ge) or <= (le) LIMIT, "-" when not, "?" when absent.
mark() {
  [[ -n "$1" && "$1" != n/a ]] || {
    echo "?"
    return
  }
  awk -v v="$1" -v l="$2" -v op="$3" \
    'BEGIN { print ((op == "ge" ? v + 0 >= l : v + 0 <= l) ? "+" : "-") }'
}
{
  gpu=$(grep -m1 -o 'gpu="[^"]*"' "$outdir/cuda_bench-${models[0]}.log" 2> /dev/null | cut -d'"' -f2)
  echo "vocabpipe vs PyTorch eager, one GPU (${gpu:-unknown}); MFU against the measured bf16" \
    "GEMM peak ${peak:-?} TFLOP/s (cuBLASLt 8192^3); 8192 tokens/step; warm-up $warmup," \
    "mean of $iters timed steps"
  printf '%-15s %7s %7s %7s | %9s %6s %11s | %9s %6s %11s | %8s\n' model "layerF" "layerBW" \
    "outS+T" "vp tok/s" "MFU" "GiB use/res" "pt tok/s" "MFU" "GiB use/res" "vp/torch"
  # Each row's numbers read once: its table row now, its targets line (issue 28's targets:
  # "+" met, "-" not, "?" not measured) after the table.
  targets=()
  for m in "${rows[@]}"; do
    f=$outdir/cuda_bench-$m.log
    t=$outdir/torch.log
    tm="TORCH model=${m%%+*} "
    [[ -f "$f" ]] || continue
    lf=$(kv "$f" "PERF section=layer" f_mfu) st=$(kv "$f" "PERF section=output" st_mfu)
    mfu=$(kv "$f" "PERF section=step" mfu) vtps=$(kv "$f" "PERF section=step" tokens_per_s)
    use=$(kv "$f" "PERF section=step" peak_inuse_gib)
    res=$(kv "$f" "PERF section=step" peak_reserved_gib)
    ttps=$(kv "$t" "$tm" tokens_per_s)
    ratio="" fill=""
    [[ -n "$vtps" && -n "$ttps" ]] &&
      ratio=$(awk -v a="$vtps" -v b="$ttps" 'BEGIN { if (b > 0) printf "%.2f", a / b }')
    [[ -n "$use" && -n "$res" ]] &&
      fill=$(awk -v u="$use" -v r="$res" 'BEGIN { if (u > 0) printf "%.2f", r / u }')
    printf '%-15s %7s %7s %7s | %9s %6s %11s | %9s %6s %11s | %8s\n' "$m" \
      "$(pct "$lf")" "$(pct "$(kv "$f" "PERF section=layer" bw_mfu)")" "$(pct "$st")" \
      "$(or_dash "$vtps")" "$(pct "$mfu")" "$(or_dash "$use")/$(or_dash "$res")" \
      "$(or_dash "$ttps")" "$(pct "$(kv "$t" "$tm" mfu)")" \
      "$(or_dash "$(kv "$t" "$tm" peak_alloc_gib)")/$(or_dash "$(kv "$t" "$tm" \
        peak_reserved_gib)")" \
      "$(or_dash "${ratio:+${ratio}x}")"
    targets+=("$(printf '%-15s layerF %s%s  outS+T %s%s  step %s%s  vp/torch %s%s  res/use %s%s' \
      "$m" "$(pct "$lf")" "$(mark "$lf" 55 ge)" "$(pct "$st")" "$(mark "$st" 65 ge)" \
      "$(pct "$mfu")" "$(mark "$mfu" 45 ge)" "$(or_dash "${ratio:+${ratio}x}")" \
      "$(mark "$ratio" 1.2 ge)" "$(or_dash "$fill")" "$(mark "$fill" 1.15 le)")")
  done
  echo "layerF/layerBW: DeviceLayerStack forward, backward (B+W); outS+T: output layer S+C1+T" \
    "(Algorithm 2); vp: cuda_bench step (runtime passes, p = 1); pt: torch autocast bf16 +" \
    "fp32 master, fused AdamW, SDPA. GiB: peak allocated / reserved over the timed steps." \
    "MODEL+NAME: the variant NAME (PERF_VARIANTS: ${variants[*]:-none})."
  echo "targets: layerF >= 55%, outS+T >= 65%, step MFU >= 45%, vp/torch >= 1.2x," \
    "reserved/in use <= 1.15 (+ met, - not met, ? not measured)"
  printf '%s\n' "${targets[@]}"
  echo "where the time goes (one profiled pass after the timed ones, CUDA events per phase; %" \
    "of the pass's device time; idle = the stream waiting after a sync; host = waiting for the" \
    "host's next launch after the backward norms):"
  for m in "${rows[@]}"; do
    f=$outdir/cuda_bench-$m.log
    [[ -f "$f" ]] || continue
    grep -h '^BREAKDOWN ' "$f" | sed "s/^BREAKDOWN /$(printf '%-15s' "$m") /"
  done
  if grep -q '^TORCH_BREAKDOWN ' "$outdir/torch.log" 2> /dev/null; then
    echo "where PyTorch eager's time goes (torch.profiler over one more step; % of its kernels'" \
      "device time by kernel family; its five longest kernels):"
    grep -h -E '^TORCH_(BREAKDOWN|KERNELS) ' "$outdir/torch.log" | sed 's/^TORCH_/torch /'
  fi
  echo "memory-bound kernels alone at each model's shape (cuda_bench's memory section: time," \
    "TB/s of the fewest bytes each must move, share of a device-to-device copy's TB/s):"
  for m in "${models[@]}"; do
    awk -v m="$m" 'index($0, "PERF section=memory ") == 1 {
        delete v
        for (i = 3; i <= NF; ++i) { split($i, p, "="); v[p[1]] = p[2] }
        cell = sprintf("%8s us %5s TB/s %4.0f%%", v["us"], v["tbps"], 100 * v["of_copy"])
        if (v["set"] == "-") { printf "%-15s %-16s %s\n", m, v["kernel"], cell; next }
        if (!(v["kernel"] in seen)) { order[++count] = v["kernel"]; seen[v["kernel"]] = 1 }
        text[v["kernel"], v["set"]] = cell
      }
      END {
        for (i = 1; i <= count; ++i) {
          k = order[i]
          printf "%-15s %-16s element %s | vector %s\n", m, k, text[k, "element"], text[k, "vector"]
        }
      }' "$outdir/cuda_bench-$m.log" 2> /dev/null
  done
  echo "attention alone at each model's shape (causal; TFLOP/s forward / backward with" \
    "FlashAttention's FLOP convention): vocabpipe's kernels (cuda_bench), then PyTorch's SDPA" \
    "with its own choice and with each backend forced:"
  for m in "${rows[@]}"; do
    f=$outdir/cuda_bench-$m.log
    k=$(kv "$f" "PERF section=attention" kernels)
    [[ -n "$k" ]] || continue
    printf '%-15s vocabpipe %-17s fwd %6s  bwd %6s TFLOP/s (%s / %s ms)\n' "$m" "$k" \
      "$(kv "$f" "PERF section=attention" fwd_tflops)" \
      "$(kv "$f" "PERF section=attention" bwd_tflops)" \
      "$(kv "$f" "PERF section=attention" fwd_ms)" "$(kv "$f" "PERF section=attention" bwd_ms)"
  done
  awk '$1 == "TORCH_ATTENTION" {
      f = ""
      for (i = 2; i <= NF; ++i) { split($i, p, "="); v[p[1]] = p[2]; f = f " " $i }
      if (f ~ / FAIL /) { sub(/^ /, "", f); printf "torch           %s\n", f; next }
      printf "%-15s torch %-21s fwd %6s  bwd %6s TFLOP/s (%s / %s ms) %s\n", v["model"],
        "sdpa-" v["backend"], v["fwd_tflops"], v["bwd_tflops"], v["fwd_ms"], v["bwd_ms"],
        v["kernel"]
    }' "$outdir/torch.log" 2> /dev/null
  for f in "$outdir"/cuda_bench-*.log "$outdir/torch.log"; do
    [[ -f "$f" ]] || continue
    grep -h -E '^(PERF section=[a-z]+ FAIL|TORCH model=[^ ]+ FAIL|TORCH no CUDA|no CUDA device)|SKIP' "$f" |
      sed "s|^|note ($(basename "$f")): |"
  done
  echo "total $((SECONDS - t_start))s of budget ${budget}s"
} | tee "$outdir/perf.txt"
