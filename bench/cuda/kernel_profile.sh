#!/usr/bin/env bash
# Nsight Compute (ncu) profiles of the hand-written kernels on the GPU host: the flash attention
# and LayerNorm kernels of one GPT-2 layer at gpt2-50k's shape (h 2048, 16 heads of 128, s 2048,
# b 2; perf.sh's first model) in its forward, backward input and weight passes, and the output
# layer's softmax rows in its S and T passes (V 50304, Algorithm 2; cuda_bench
# --sections=layer,output --layers=1), once with the default kernels and once with the opt-in
# ones (VOCABPIPE_ATTENTION=flash-pipelined, VOCABPIPE_MEMORY_KERNELS=vector), then the wide
# flash forward alone (VOCABPIPE_ATTENTION=flash-wide: 32 query rows per warp). Per kernel: speed
# of light, occupancy, launch statistics, warp states (what the warps stall on), memory and
# compute workload, shared-memory bank conflicts, and ncu's own advice. perf.sh says how long a
# kernel takes; this says why (global-memory latency, shared-memory bandwidth, occupancy), so the
# next change is chosen from a reading, not a guess.
#
#   bench/cuda/kernel_profile.sh OUTDIR            on the GPU host (about 20-40 s)
#   bench/cuda/kernel_profile.sh --dry-run OUTDIR  anywhere: checks the inputs, prints the commands
#
# Environment: VP_BIN_ENV (prefix for cuda_bench, split on spaces, as perf.sh), NCU (default:
# ncu on PATH, else the newest /opt/nvidia/nsight-compute/*/ncu, else /usr/local/cuda/bin/ncu),
# CUDA_BENCH (default: beside this script, then build-cuda/, build/), PYTHON (python3; reads the
# model's flags from torch_baseline.py), VP_HOST_LD_LIBRARY_PATH (as perf.sh, for python3).
# Output: OUTDIR/ncu-default.txt, ncu-opt-in.txt, ncu-wide.txt (ncu's reports), OUTDIR/ncu-summary.txt
# (per kernel: duration, throughputs, occupancy, registers, the first line of ncu's advice), also
# on stdout.
# Exit status: 0 when the three profiles ran, 1 when one failed, 2 on bad usage or missing inputs.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=bench/cuda/bench_common.sh
. "$here/bench_common.sh"
parse_bench_options kernel_profile.sh "kernel_profile.sh [--dry-run] OUTDIR" 0 "$@"
bench_programs "$here"
ncu=${NCU:-}
if [[ -z "$ncu" ]]; then
  ncu=$(command -v ncu 2> /dev/null)
  if [[ -z "$ncu" ]]; then
    for c in $(printf "%s\n" /opt/nvidia/nsight-compute/*/ncu | sort -V -r) \
      /usr/local/cuda/bin/ncu; do
      if [[ -x "$c" ]]; then
        ncu=$c
        break
      fi
    done
  fi
fi

missing=0
[[ -n "$bench" && -x "$bench" ]] || {
  echo "kernel_profile.sh: cuda_bench not found (beside the script, build-cuda/, build/ or" \
    "\$CUDA_BENCH)" >&2
  missing=1
}
[[ -f "$here/torch_baseline.py" ]] || {
  echo "kernel_profile.sh: $here/torch_baseline.py not found" >&2
  missing=1
}
((missing)) && exit 2
flags=$("${py_env[@]}" "$python" "$here/torch_baseline.py" --cuda-bench-flags gpt2-50k) || {
  echo "kernel_profile.sh: torch_baseline.py --cuda-bench-flags failed" >&2
  exit 2
}

# One layer's F, B and W with one timed iteration: 2 LayerNorm forwards, the flash forward, the
# delta kernel, the dK/dV and dQ kernels, 2 LayerNorm input and 2 weight gradients; then the
# output layer's S and T: the softmax row kernels. The regex matches the kernels' function names;
# 14 launches cover each once.
# shellcheck disable=SC2206,SC2054  # flags are words; commas inside a flag
bench_cmd=("${bin_env[@]}" "$bench" --sections=layer,output --algorithm=2 --warmup=0 --iters=1
  $flags --layers=1)
ncu_select=(--kernel-name "regex:Flash|Norm|AttentionDelta|VocabSoftmax" --launch-count 14)
# The wide flash forward (VOCABPIPE_ATTENTION=flash-wide) alone: its backward kernels are the
# pipelined ones, profiled in the opt-in run.
ncu_select_wide=(--kernel-name "regex:FlashForwardWide" --launch-count 1)
ncu_opts=(--clock-control none --kernel-name-base function
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
  --section SchedulerStats --section MemoryWorkloadAnalysis
  --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis)

if ((dry_run)); then
  echo "kernel_profile.sh --dry-run: ncu ${ncu:-(not found)}"
  echo "  would run: ${ncu:-ncu} ${ncu_select[*]} ${ncu_opts[*]} ${bench_cmd[*]}" \
    "> $outdir/ncu-default.txt"
  echo "  would run: ${ncu:-ncu} ... (VOCABPIPE_ATTENTION=flash-pipelined VOCABPIPE_MEMORY_KERNELS=vector)" \
    "> $outdir/ncu-opt-in.txt"
  echo "  would run: ${ncu:-ncu} ${ncu_select_wide[*]} ... (VOCABPIPE_ATTENTION=flash-wide)" \
    "> $outdir/ncu-wide.txt"
  exit 0
fi
[[ -n "$ncu" ]] || {
  echo "kernel_profile.sh: ncu not found (PATH, /opt/nvidia/nsight-compute, /usr/local/cuda/bin" \
    "or \$NCU)" >&2
  exit 2
}

# The summary of one report: each kernel's short name (template arguments kept), then the
# metrics that say what bounds it and the first line of each piece of ncu's advice.
summarize() {
  awk '
    /^  [^ ].*\([0-9]+, [0-9]+, [0-9]+\)x\(/ {
      name = $0
      sub(/^ +/, "", name)
      sub(/^void /, "", name)
      gsub(/vp::engine::cuda::|\(anonymous namespace\)::|<unnamed>::/, "", name)
      sub(/\(.*$/, "", name)   # drop the parameter list and the launch shape
      printf "%s\n", name
      next
    }
    /^ +(Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Block Limit Registers|Block Limit Shared Mem|Warp Cycles Per Issued Instruction|Issue Slots Busy|No Eligible) / {
      line = $0
      gsub(/ +/, " ", line)
      printf "   %s\n", line
      next
    }
    /^ +(OPT|WRN) +/ {  # the first line of each piece of advice
      line = $0
      gsub(/ +/, " ", line)
      printf "   %s\n", substr(line, 1, 400)
    }' "$1"
}

status=0
t0=$SECONDS
variants=(default opt-in wide)
for variant in "${variants[@]}"; do
  report=$outdir/ncu-$variant.txt
  envs=()
  select=("${ncu_select[@]}")
  case $variant in
    opt-in) envs=(env VOCABPIPE_ATTENTION=flash-pipelined VOCABPIPE_MEMORY_KERNELS=vector) ;;
    wide)
      envs=(env VOCABPIPE_ATTENTION=flash-wide)
      select=("${ncu_select_wide[@]}")
      ;;
  esac
  if "$ncu" "${select[@]}" "${ncu_opts[@]}" "${envs[@]}" "${bench_cmd[@]}" > "$report" 2>&1; then
    echo "== ncu $variant: ok ($(grep -c 'Section: GPU Speed Of Light' "$report") kernels," \
      "$((SECONDS - t0)) s)"
  else
    echo "== ncu $variant: FAIL: $(grep -m1 -E '==ERROR==|error' "$report" || tail -1 "$report")"
    status=1
  fi
done
{
  for variant in "${variants[@]}"; do
    echo "---- $variant kernels (ncu-$variant.txt)"
    summarize "$outdir/ncu-$variant.txt"
  done
} | tee "$outdir/ncu-summary.txt"
exit $status
