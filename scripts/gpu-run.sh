#!/usr/bin/env bash
# run.sh of the GPU bundle (scripts/gpu-bundle.sh packs this file as vocabpipe-gpu/run.sh next
# to bin/, tests/, bench/, lib/, examples/ and compare.py). Every CUDA check in one run of under
# 10 minutes (VP_GPU_BUDGET_S, default 540 s), logs in LOGDIR:
#
#   bash gpu-bundle/run.sh LOGDIR            on the GPU host (unpacks, then runs this)
#   run.sh --dry-run LOGDIR                  everything that runs without a GPU (the proof on
#                                            the build machine): CUDA tests skip their device
#                                            parts, CPU reference jobs run 3 steps
#
# In order: the host (nvidia-smi, driver, glibc), the host's cuBLAS/cuBLASLt/NCCL (found in
# VP_CUDA_LIB_DIRS, the folder of nvcc's toolkit, /usr/local/cuda*, the Python environment's
# nvidia-* packages; printed), ldd of every executable; the CPU reference jobs start in the
# background; the test executables (gtest XML + logs); the end-to-end `vocabpipe run` jobs on
# the GPU (p = 1 fp32 and bf16 for 200 steps, p = 2 vocab1 and vocab2 sharing the GPU for 20
# steps); cuda_bench; compare.py (the CUDA losses against the CPU ones). Every check prints one
# PASS / FAIL / SKIP line, collected in LOGDIR/summary.txt. Exit status 0 when nothing failed.
# Each step runs under `timeout` bounded by the time left, so a hang costs its step, not the run.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DRY=0
if [[ "${1:-}" == --dry-run ]]; then
  DRY=1
  shift
fi
if [[ $# -ne 1 ]]; then
  echo "usage: run.sh [--dry-run] LOGDIR" >&2
  exit 2
fi
mkdir -p "$1"
LOGDIR=$(cd "$1" && pwd)
BUDGET=${VP_GPU_BUDGET_S:-540}
SUMMARY="$LOGDIR/summary.txt"
: > "$SUMMARY"
FAILS=0
WORK=$(mktemp -d "${TMPDIR:-/tmp}/vocabpipe-gpu-work.XXXXXX")  # run dirs (checkpoints stay here)

say() { echo "$*" | tee -a "$SUMMARY"; }
result() {  # PASS|FAIL|SKIP|INFO NAME [DETAIL]
  [[ "$1" == FAIL ]] && FAILS=$((FAILS + 1))
  say "$1 $2${3:+: $3}"
}
left() { echo $((BUDGET - SECONDS)); }
# capped CAP CMD...: CMD under timeout min(CAP, time left - 20 s); 124 without running when
# fewer than 10 s would be left.
capped() {
  local cap=$1 t
  shift
  t=$(($(left) - 20))
  ((t > cap)) && t=$cap
  ((t < 10)) && return 124
  timeout --kill-after=10 "$t" "$@"
}

say "== vocabpipe GPU checks, $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET}s$(
  ((DRY)) && echo ', dry run')"
{
  cat "$HERE/MANIFEST" 2> /dev/null
  echo "host: $(hostname) $(uname -srm), $(nproc) cores, $(ldd --version 2>&1 | head -1)"
  command -v nvcc > /dev/null && nvcc --version | tail -2
  command -v python3 > /dev/null && python3 --version
} > "$LOGDIR/env.txt" 2>&1

# ---- 1. the GPU
export CUDA_MODULE_LOADING=EAGER  # the programs set it too (worker/launch/cuda_environment.h)
GPUS=0
if command -v nvidia-smi > /dev/null; then
  nvidia-smi > "$LOGDIR/nvidia-smi.txt" 2>&1
  nvidia-smi -L >> "$LOGDIR/nvidia-smi.txt" 2>&1
  GPUS=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU ' || true)
fi
if ((GPUS > 0)); then
  result INFO nvidia-smi "$(nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader 2> /dev/null | head -1) ($GPUS GPU)"
elif ((DRY)); then
  result SKIP nvidia-smi "no GPU (dry run)"
else
  result FAIL nvidia-smi "no GPU visible: running the device-free part only"
  DRY=1
fi

# ---- 2. libraries: the bundle's lib/ plus the host's CUDA libraries (host-libs.txt)
cuda_candidates() {
  local d nvcc
  if [[ -n "${VP_CUDA_LIB_DIRS:-}" ]]; then tr ':' '\n' <<< "$VP_CUDA_LIB_DIRS"; fi
  nvcc=$(command -v nvcc || true)
  if [[ -n "$nvcc" ]]; then
    d=$(dirname "$(readlink -f "$nvcc")")/..
    echo "$d/lib64" "$d/lib" "$d/targets/x86_64-linux/lib" | tr ' ' '\n'
  fi
  [[ -n "${CUDA_HOME:-}" ]] && echo "$CUDA_HOME/lib64"
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda-*/lib64 /usr/local/cuda-*/lib \
    /usr/local/cuda/targets/x86_64-linux/lib; do echo "$d"; done
  # The Python environment's nvidia-* wheels (nvidia/<pkg>/lib, or nvidia/cu13/lib for CUDA 13).
  for py in python3 python; do
    command -v "$py" > /dev/null || continue
    "$py" - << 'PY' 2> /dev/null
import glob, os
try:
    import nvidia
    roots = list(nvidia.__path__)
except Exception:
    roots = []
try:
    import site
    roots += [os.path.join(p, "nvidia") for p in site.getsitepackages()]
except Exception:
    pass
seen = set()
for root in roots:
    for so in glob.glob(os.path.join(root, "**", "lib*.so*"), recursive=True):
        d = os.path.dirname(so)
        if d not in seen:
            seen.add(d)
            print(d)
PY
    break
  done
  echo /usr/lib/x86_64-linux-gnu
}
mapfile -t candidates < <(cuda_candidates | awk 'NF && !seen[$0]++')
LIBPATH="$HERE/lib"
missing=""
while read -r soname; do
  [[ -z "$soname" ]] && continue
  found=""
  for d in "${candidates[@]}"; do
    if [[ -e "$d/$soname" ]]; then
      found=$(cd "$d" && pwd -P)
      break
    fi
  done
  if [[ -z "$found" ]]; then  # last resort: anywhere on this host (bounded)
    hit=$(timeout 30 find / -xdev \( -path /proc -o -path /sys \) -prune -o -name "$soname" \
      -print 2> /dev/null | head -1)
    [[ -n "$hit" ]] && found=$(cd "$(dirname "$hit")" && pwd -P)
  fi
  if [[ -n "$found" ]]; then
    say "     $soname: $found"
    [[ ":$LIBPATH:" == *":$found:"* ]] || LIBPATH="$LIBPATH:$found"
  else
    missing="$missing $soname"
  fi
done < "$HERE/host-libs.txt"
if [[ -n "$missing" ]]; then
  result FAIL host-libraries "not found:$missing (set VP_CUDA_LIB_DIRS=dir1:dir2)"
else
  result PASS host-libraries "$(tr '\n' ' ' < "$HERE/host-libs.txt")"
fi
# Only our executables (and the processes they start) get the path: host tools such as python3
# must keep loading the host's own libssl, libz, libstdc++.
VPENV=(env "LD_LIBRARY_PATH=$LIBPATH")
VP=("${VPENV[@]}" "$HERE/bin/vocabpipe")
say "     LD_LIBRARY_PATH=$LIBPATH (for the bundle's executables)"
: > "$LOGDIR/ldd.txt"
for exe in "$HERE"/bin/* "$HERE"/tests/* "$HERE"/bench/*; do
  echo "== $exe" >> "$LOGDIR/ldd.txt"
  "${VPENV[@]}" ldd "$exe" >> "$LOGDIR/ldd.txt" 2>&1
done
if grep -q "not found" "$LOGDIR/ldd.txt"; then
  result FAIL ldd "$(grep 'not found' "$LOGDIR/ldd.txt" | sort -u | tr -s ' \t\n' ' ')"
else
  result PASS ldd "every library of $(grep -c '^== ' "$LOGDIR/ldd.txt") executables found"
fi

# ---- 3. the corpus, the specs, and the CPU reference jobs (background: they need only CPUs)
CPU_STEPS=${VP_CPU_STEPS:-$( ((DRY)) && echo 3 || echo 20)}
CPU_THREADS=${VP_CPU_THREADS:-4}
synth=$("${VP[@]}" data synth --vocab 4096 --tokens 1000000 --out "$WORK/gpu-data.bin" --seed 7 2>&1)
echo "$synth" > "$LOGDIR/synth.txt"
FLOOR=$(sed -n 's/.*entropy rate \([0-9.]*\).*/\1/p' <<< "$synth" | head -1)
cp "$HERE"/examples/gpu-*.yaml "$WORK/"
cpu_spec() {  # NAME: the CPU copy of examples/NAME.yaml (same model, data, seed; fp32 on cpu)
  sed -e "s/^device: cuda.*/device: cpu/" -e "s/^precision: .*/precision: fp32/" \
    -e "s/^name: .*/name: $1-cpu/" -e "s#runs/$1,#runs/$1-cpu,#" \
    -e "s/seed: 1234}/seed: 1234, threads: $CPU_THREADS}/" "$WORK/$1.yaml" > "$WORK/$1-cpu.yaml"
}
CPU_REFS=(gpu-p1-fp32 gpu-p2-vocab1 gpu-p2-vocab2 gpu-llama-p2)
for n in "${CPU_REFS[@]}"; do cpu_spec "$n"; done
(
  for n in "${CPU_REFS[@]}"; do
    start=$SECONDS
    capped 300 "${VP[@]}" run "$WORK/$n-cpu.yaml" --steps "$CPU_STEPS" > "$LOGDIR/e2e-$n-cpu.log" 2>&1
    echo "$n-cpu exit $? after $((SECONDS - start)) s" >> "$LOGDIR/cpu-refs.txt"
  done
) &
CPU_PID=$!

# ---- 4. the test executables
run_test() {  # NAME CAP
  local name=$1 cap=$2 rc t0=$SECONDS passed skipped failed detail
  if [[ ! -x "$HERE/tests/$name" ]]; then
    result FAIL "$name" "not in the bundle"
    return
  fi
  capped "$cap" "${VPENV[@]}" "$HERE/tests/$name" --gtest_output="xml:$LOGDIR/$name.xml" \
    > "$LOGDIR/$name.log" 2>&1
  rc=$?
  passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$LOGDIR/$name.log" | tail -1)
  skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$LOGDIR/$name.log" | tail -1)
  failed=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' "$LOGDIR/$name.log" | tail -1)
  detail="${passed:-0} passed, ${skipped:-0} skipped, ${failed:-0} failed, $((SECONDS - t0)) s"
  if ((rc == 124 || rc == 137)); then
    result FAIL "$name" "timed out ($detail; last: $(tail -1 "$LOGDIR/$name.log"))"
  elif ((rc != 0)); then
    result FAIL "$name" "exit $rc ($detail; $(grep -m3 '^\[  FAILED  \] [A-Z]' "$LOGDIR/$name.log" |
      sed 's/^\[  FAILED  \] //' | tr '\n' ' '))"
  elif ((!DRY)) && grep -q "no CUDA device" "$LOGDIR/$name.log"; then
    result FAIL "$name" "CUDA sees no device although nvidia-smi does (driver older than the \
CUDA 13 runtime?) ($detail)"
  else
    result PASS "$name" "$detail"
  fi
}
say "== tests"
run_test cuda_runtime_test 60
run_test cuda_kernels_test 120
run_test cuda_layer_stack_test 120
run_test cuda_vocab_shards_test 120
run_test cuda_pipeline_test 240
run_test cuda_nccl_test 60
for t in gloo_communicator_test engine_kernels_test p2p_order_test; do run_test "$t" 60; done

# ---- 5. end-to-end jobs on the GPU
keep_run() {  # NAME: metrics and logs of runs/NAME into LOGDIR/runs/NAME
  local src="$WORK/runs/$1"
  [[ -d "$src" ]] || return 0
  mkdir -p "$LOGDIR/runs/$1"
  cp "$src"/metrics.jsonl "$src"/*.log "$LOGDIR/runs/$1/" 2> /dev/null
  return 0
}
say "== end-to-end (vocabpipe run, device: cuda)"
if ((DRY)); then
  capped 60 "${VP[@]}" run "$WORK/gpu-p1-fp32.yaml" > "$LOGDIR/e2e-gpu-p1-fp32.log" 2>&1
  rc=$?
  if ((rc == 2)) && grep -q "device: cuda" "$LOGDIR/e2e-gpu-p1-fp32.log"; then
    result PASS e2e-refused-without-gpu "$(tail -1 "$LOGDIR/e2e-gpu-p1-fp32.log")"
  else
    result FAIL e2e-refused-without-gpu "exit $rc: $(tail -1 "$LOGDIR/e2e-gpu-p1-fp32.log")"
  fi
else
  for n in gpu-p1-fp32 gpu-p1-bf16 gpu-p2-vocab1 gpu-p2-vocab2 gpu-llama-p2; do
    t0=$SECONDS
    capped 150 "${VP[@]}" run "$WORK/$n.yaml" > "$LOGDIR/e2e-$n.log" 2>&1
    rc=$?
    keep_run "$n"
    if ((rc == 0)); then
      result PASS "e2e-$n" "$(grep -m1 '^done:' "$LOGDIR/e2e-$n.log"), $((SECONDS - t0)) s"
    else
      result FAIL "e2e-$n" "exit $rc after $((SECONDS - t0)) s: $(tail -1 "$LOGDIR/e2e-$n.log")"
      # Without the control plane (rank processes started directly): separates a device
      # failure from a control-plane one.
      sed -e "s#runs/$n,#runs/$n-direct,#" "$WORK/$n.yaml" > "$WORK/$n-direct.yaml"
      capped 120 "${VP[@]}" run --direct "$WORK/$n-direct.yaml" > "$LOGDIR/e2e-$n-direct.log" 2>&1
      rc=$?
      keep_run "$n-direct"
      result INFO "e2e-$n --direct" "exit $rc: $(tail -1 "$LOGDIR/e2e-$n-direct.log")"
    fi
  done
fi

# ---- 6. the benchmark
say "== cuda_bench"
capped 120 "${VPENV[@]}" "$HERE/bench/cuda_bench" > "$LOGDIR/cuda_bench.txt" 2>&1
rc=$?
if ((rc == 0)) && ((!DRY)) && grep -q "no CUDA device" "$LOGDIR/cuda_bench.txt"; then
  result FAIL cuda_bench "CUDA sees no device although nvidia-smi does"
elif ((rc == 0)); then
  result "$( ((DRY)) && echo SKIP || echo PASS)" cuda_bench \
    "$(grep -c . "$LOGDIR/cuda_bench.txt") lines in cuda_bench.txt ($(head -1 "$LOGDIR/cuda_bench.txt"))"
else
  result FAIL cuda_bench "exit $rc: $(tail -1 "$LOGDIR/cuda_bench.txt")"
fi

# ---- 7. the CPU references, then the comparison
say "== comparison"
while kill -0 "$CPU_PID" 2> /dev/null && (($(left) > 15)); do sleep 2; done
if kill -0 "$CPU_PID" 2> /dev/null; then
  kill -- "$CPU_PID" 2> /dev/null
  result FAIL cpu-references "still running at the end of the budget"
fi
wait "$CPU_PID" 2> /dev/null
for n in "${CPU_REFS[@]}"; do keep_run "$n-cpu"; done
while read -r line; do
  case "$line" in
    *"exit 0 "*) result PASS "e2e-${line%% exit*}" "${line#* exit 0 }" ;;
    *) result FAIL "e2e-${line%% exit*}" "exit ${line#* exit }" ;;
  esac
done < <(cat "$LOGDIR/cpu-refs.txt" 2> /dev/null)
compare_args=("$LOGDIR/runs" --cpu-steps "$CPU_STEPS")
[[ -n "$FLOOR" ]] && compare_args+=(--floor "$FLOOR")
((DRY)) && compare_args+=(--cpu-only)
if command -v python3 > /dev/null; then
  python3 "$HERE/compare.py" "${compare_args[@]}" > "$LOGDIR/compare.txt" 2>&1
  while read -r verdict rest; do
    case "$verdict" in
      PASS | FAIL | SKIP | INFO) result "$verdict" "$rest" ;;
    esac
  done < "$LOGDIR/compare.txt"
else
  result FAIL compare "no python3 on this host"
fi

rm -rf "$WORK"
say "== $FAILS failed, $((SECONDS)) s; logs in $LOGDIR"
((FAILS == 0))
