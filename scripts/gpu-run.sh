#!/usr/bin/env bash
# run.sh of the GPU bundle (scripts/gpu-bundle.sh packs this file as vocabpipe-gpu/run.sh next
# to bin/, tests/, bench/, lib/, refs/, examples/ and compare.py). Every CUDA check in one run
# of about 5 minutes (VP_GPU_BUDGET_S, default 330 s):
#
#   bash gpu-bundle/run.sh LOGDIR             on the GPU host (unpacks, then runs this)
#   run.sh --dry-run LOGDIR                   everything that runs without a GPU (the proof on
#                                             the build machine): CUDA tests skip their device
#                                             parts, the shipped CPU references are checked
#   run.sh --make-references REFDIR           (gpu-bundle.sh, on the build machine) the CPU
#                                             reference jobs, whose metrics the bundle ships
#   VP_GPU_ONLY=perf bash gpu-bundle/run.sh LOGDIR
#                                             the preflight and bench/perf.sh only (its
#                                             PERF_VARIANTS from the environment, then
#                                             kernel_profile.sh if time is left): a second GPU
#                                             call that measures the winners of the first
#                                             without its tests and jobs (~2-3 minutes)
# Another VP_GPU_ONLY value, or a VP_GPU_BUDGET_S that is no whole number of seconds, is refused
# before anything runs (exit 2): a misspelt setting would spend the GPU's minutes on another run.
#
# LOGDIR receives three files only, so that all of it comes back from a host that returns a
# few files: summary.txt (one PASS / FAIL / SKIP / INFO line per check, then the first lines
# of each failure's log), logs.tgz (every log, gtest XML, metrics.jsonl and rank log), and
# perf.txt (the performance table, when bench/perf.sh ran). Standard output carries the same
# summary, so the end of the output alone is enough to plan the next run.
#
# In order of value, so that a run cut short by its budget loses the least useful checks:
#   1. preflight (seconds): the GPU (nvidia-smi: name, driver, compute mode), the libraries
#      (the bundle's lib/, the host's cuBLASLt/NCCL, the driver's libcuda; LD_LIBRARY_PATH
#      extended, never replaced), glibc versions, and one CUDA context timed; a GPU that CUDA
#      cannot see stops the device part at once, with the facts (env, ldconfig, nvidia-smi -q);
#   2. cuda_library_loading_test (the host's cuBLASLt and NCCL open and export every function
#      the backend calls: they are opened at run time, so ldd cannot vouch for them),
#      cuda_runtime_test, cuda_kernels_test;
#   3. `vocabpipe run` p = 1 fp32 (200 steps) through the control plane;
#   4. cuda_pipeline_test;
#   5. the other jobs (p = 1 bf16, p = 2 vocab1 / vocab2 / Llama sharing the GPU) and tests,
#      d = 2 × p = 2 and t = 2 × p = 2 on the one GPU (while validation refuses them on cuda:
#      with VOCABPIPE_UNVERIFIED_CUDA once their cuda_pipeline_test cases passed, else SKIP),
#      then the layer stack and the bf16 job with each opt-in kernel set: the pipelined and the
#      wide flash attention kernels (VOCABPIPE_ATTENTION=flash-pipelined, flash-wide; the flash
#      ones are the default), the 16-byte memory-bound kernels (VOCABPIPE_MEMORY_KERNELS=vector)
#      and the cuBLASLt epilogues: bias, GELU and the residual as the GEMM's C matrix
#      (VOCABPIPE_GEMM_EPILOGUE=all, runs named gpu-p1-bf16-epilogues);
#   6. bench/perf.sh (the performance baseline: issue 28's table, its per-phase breakdown and
#      the PERF_VARIANTS rows, as many as its budget allows) when the bundle has it, then
#      cuda_bench's bare sections, then bench/kernel_profile.sh (Nsight Compute on the flash and
#      norm kernels) when ncu is there;
#   7. compare.py: the GPU losses against the CPU references shipped in refs/.
# The CPU tests are not run here: CI runs them. Each step runs under `timeout` bounded by the
# time left, so a hang costs its step, not the run; steps 2-5 leave VP_GPU_PERF_RESERVE_S
# (120 s) of the budget to step 6, and a step not started for lack of time is a SKIP saying so.
# logs.tgz is packed after each phase and again at the end, and a TERM or INT (the caller's
# time limit) is noted in the summary before the last pack.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
MODE=gpu
case "${1:-}" in
  --dry-run) MODE=dry; shift ;;
  --make-references) MODE=refs; shift ;;
esac
if [[ $# -ne 1 ]]; then
  echo "usage: run.sh [--dry-run | --make-references REFDIR] LOGDIR" >&2
  exit 2
fi
DRY=0
[[ "$MODE" != gpu ]] && DRY=1
PERF_ONLY=0
# A misspelt setting would spend the GPU's minutes on the wrong run: refused before anything.
case "${VP_GPU_ONLY:-}" in
  "") ;;
  perf) PERF_ONLY=1 ;;
  *)
    echo "run.sh: VP_GPU_ONLY must be perf or unset" >&2
    exit 2
    ;;
esac
if [[ -n "${VP_GPU_PERF_RESERVE_S:-}" && ! "${VP_GPU_PERF_RESERVE_S}" =~ ^[0-9]+$ ]]; then
  echo "run.sh: VP_GPU_PERF_RESERVE_S must be a whole number of seconds" >&2
  exit 2
fi
if [[ -n "${VP_GPU_BUDGET_S:-}" && ! "${VP_GPU_BUDGET_S}" =~ ^[1-9][0-9]*$ ]]; then
  echo "run.sh: VP_GPU_BUDGET_S must be a whole number of seconds" >&2
  exit 2
fi
REF_STEPS=20      # steps of each CPU reference (and of the fp32 comparison)
CPU_THREADS=4     # BLAS threads per CPU reference rank
CPU_REFS=(gpu-p1-fp32 gpu-p2-vocab1 gpu-p2-vocab2 gpu-llama-p2 gpu-d2-p2 gpu-t2-p2)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/vocabpipe-gpu-work.XXXXXX")  # runs, data, specs
LOGS="$WORK/logs"  # everything that goes into logs.tgz
mkdir -p "$LOGS"
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}  # an NCCL failure explains itself in the log
export CUDA_MODULE_LOADING=EAGER       # the programs set it too (worker/launch/cuda_environment.h)

# The learnable corpus every job trains on (a Markov chain with a known entropy floor), and
# the jobs' specs, in WORK. Prints the synth output.
make_data() {
  "$@" data synth --vocab 4096 --tokens 1000000 --out "$WORK/gpu-data.bin" --seed 7 2>&1
  cp "$HERE"/examples/gpu-*.yaml "$WORK/"
}
cpu_spec() {  # NAME: the CPU copy of examples/NAME.yaml (same model, data, seed; fp32 on cpu)
  sed -e "s/^device: cuda.*/device: cpu/" -e "s/^precision: .*/precision: fp32/" \
    -e "s/^name: .*/name: $1-cpu/" -e "s#runs/$1,#runs/$1-cpu,#" \
    -e "s/seed: 1234}/seed: 1234, threads: $CPU_THREADS}/" "$WORK/$1.yaml" > "$WORK/$1-cpu.yaml"
}

# ---- --make-references REFDIR: the CPU runs the GPU results are compared with (build machine)
if [[ "$MODE" == refs ]]; then
  mkdir -p "$1"
  REFDIR=$(cd "$1" && pwd)
  VP=(env "LD_LIBRARY_PATH=$HERE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$HERE/bin/vocabpipe")
  make_data "${VP[@]}" > "$REFDIR/synth.txt" || { cat "$REFDIR/synth.txt" >&2; exit 1; }
  sha256sum "$WORK/gpu-data.bin" | cut -d' ' -f1 > "$REFDIR/data.sha256"
  (cd "$WORK" && for n in "${CPU_REFS[@]}"; do
    cpu_spec "$n"
    start=$SECONDS
    if ! "${VP[@]}" run "$n-cpu.yaml" --steps "$REF_STEPS" > "$LOGS/$n-cpu.log" 2>&1; then
      echo "run.sh: the CPU reference $n failed:" >&2
      tail -20 "$LOGS/$n-cpu.log" >&2
      exit 1
    fi
    mkdir -p "$REFDIR/$n-cpu"
    cp "runs/$n-cpu/metrics.jsonl" "$REFDIR/$n-cpu/"
    echo "run.sh: CPU reference $n: $REF_STEPS steps in $((SECONDS - start)) s"
  done) || { rm -rf "$WORK"; exit 1; }
  rm -rf "$WORK"
  exit 0
fi

mkdir -p "$1"
LOGDIR=$(cd "$1" && pwd)
BUDGET=${VP_GPU_BUDGET_S:-330}
SUMMARY="$LOGDIR/summary.txt"
: > "$SUMMARY"
FAILS=0
FAIL_LOGS=()  # the log of each failure, for the excerpts at the end

say() { echo "$*" | tee -a "$SUMMARY"; }
result() {  # PASS|FAIL|SKIP|INFO NAME [DETAIL [LOG]]
  if [[ "$1" == FAIL ]]; then
    FAILS=$((FAILS + 1))
    [[ -n "${4:-}" ]] && FAIL_LOGS+=("$4")
  fi
  say "$1 $2${3:+: $3}"
}
left() { echo $((BUDGET - SECONDS)); }
# Seconds the tests and jobs leave for the benchmarks (issue 28's table: perf.sh's rows need
# about 60 s on an H100, its PyTorch baseline included); 0 once the benchmarks start.
RESERVE=${VP_GPU_PERF_RESERVE_S:-120}
((DRY)) && RESERVE=0  # a dry run's benchmarks take seconds
NOT_RUN=125  # capped's status for a step it did not start (no time left)
# capped CAP CMD...: CMD under timeout min(CAP, time left - RESERVE - 15 s); NOT_RUN without
# running when fewer than 5 s would be left.
capped() {
  local cap=$1 t
  shift
  t=$(($(left) - RESERVE - 15))
  ((t > cap)) && t=$cap
  ((t < 5)) && return "$NOT_RUN"
  timeout --kill-after=5 "$t" "$@"
}
# not_started NAME: the SKIP line of a step capped did not start (NOT_RUN).
not_started() {
  result SKIP "$1" "not started: $(left) s of the budget left$(
    ((RESERVE > 0)) && echo ", $RESERVE s kept for the benchmarks")"
}
# pack: the logs so far into logs.tgz (after each phase, so a run cut by the caller's time
# limit, even by SIGKILL, still leaves the phases it finished).
pack() {
  cp "$SUMMARY" "$LOGS/summary.txt" 2> /dev/null
  tar -C "$WORK" -czf "$LOGDIR/logs.tgz.part" logs 2> /dev/null &&
    mv -f "$LOGDIR/logs.tgz.part" "$LOGDIR/logs.tgz"
}
# The first lines of a failure in LOG: gtest failures, errors, the tail otherwise.
excerpt() {
  local log=$1
  [[ -f "$log" ]] || return 0
  echo "---- ${log#"$LOGS"/}"
  if grep -qE 'Failure|FAILED|[Ee]rror|error:|what\(\)' "$log"; then
    grep -m6 -B2 -A8 -E 'Failure$|Failure:|\[  FAILED  \]|[Ee]rror|what\(\)' "$log" | head -40
  else
    tail -15 "$log"
  fi
}
finish() {  # the archive and the failures' first lines; runs once, also on an early exit
  trap - EXIT
  pack
  if ((${#FAIL_LOGS[@]} > 0)); then
    say "== the first lines of each failure (all logs in $LOGDIR/logs.tgz)"
    local seen="" log
    for log in "${FAIL_LOGS[@]}"; do
      [[ " $seen " == *" $log "* ]] && continue
      seen="$seen $log"
      excerpt "$log" | tee -a "$SUMMARY"
    done
  fi
  say "== $FAILS failed, $SECONDS s; $LOGDIR: summary.txt, logs.tgz$(
    [[ -f "$LOGDIR/perf.txt" ]] && echo ', perf.txt')"
  if [[ "${VP_KEEP_WORK:-0}" == 1 ]]; then echo "work folder kept: $WORK"; else rm -rf "$WORK"; fi
}
trap finish EXIT
# The caller's time limit: say so in the summary (the step then in flight has no line), then
# finish (the EXIT trap) packs what there is.
trap 'say "INTERRUPTED by a signal after $SECONDS s (budget $BUDGET s)"; exit 143' TERM INT

say "== vocabpipe GPU checks, $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET}s$(
  ((DRY)) && echo ', dry run')"
{
  cat "$HERE/MANIFEST" 2> /dev/null
  echo "host: $(hostname) $(uname -srm), $(nproc) cores, $(ldd --version 2>&1 | head -1)"
  command -v nvcc > /dev/null && nvcc --version | tail -2
  command -v python3 > /dev/null && python3 --version
} > "$LOGS/env.txt" 2>&1
say "     bundle: $(sed -n 's/^source: *//p' "$HERE/MANIFEST" 2> /dev/null | head -1)"

# ---- 1. preflight: the GPU
GPUS=0
if command -v nvidia-smi > /dev/null; then
  timeout 20 nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1
  timeout 20 nvidia-smi -L >> "$LOGS/nvidia-smi.txt" 2>&1
  GPUS=$(timeout 20 nvidia-smi -L 2> /dev/null | grep -c '^GPU ' || true)
fi
if ((GPUS > 0)); then
  result INFO nvidia-smi "$(timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode \
    --format=csv,noheader 2> /dev/null | head -1) ($GPUS GPU)"
  if timeout 20 nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2> /dev/null | grep -qi exclusive; then
    result INFO compute-mode "exclusive: the p = 2 jobs (two processes on one GPU) cannot run"
  fi
elif ((DRY)); then
  result SKIP nvidia-smi "no GPU (dry run)"
else
  result FAIL nvidia-smi "no GPU visible: running the device-free part only" "$LOGS/nvidia-smi.txt"
  DRY=1
  RESERVE=0
fi

# ---- 1b. preflight: the libraries (the bundle's lib/, then the host's CUDA libraries, then the
# driver's folder, then whatever the caller had: extended, never replaced)
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
{
  echo "== candidate folders"
  printf '%s\n' "${candidates[@]}"
  echo "== every libcublas*/libnccl*/libcuda* in them"
  for d in "${candidates[@]}"; do
    ls -1 "$d"/libcublas* "$d"/libnccl* "$d"/libcuda.so* 2> /dev/null
  done
} > "$LOGS/libraries.txt"
LIBPATH="$HERE/lib"
add_path() { [[ ":$LIBPATH:" == *":$1:"* ]] || LIBPATH="$LIBPATH:$1"; }
missing=""
find_budget=$((SECONDS + 10))  # the last-resort search of the whole host, 10 s in all
while read -r soname; do
  [[ -z "$soname" ]] && continue
  found=""
  for d in "${candidates[@]}"; do
    if [[ -e "$d/$soname" ]]; then
      found=$(cd "$d" && pwd -P)
      break
    fi
  done
  if [[ -z "$found" ]] && ((SECONDS < find_budget)); then
    hit=$(timeout $((find_budget - SECONDS)) find / -xdev \( -path /proc -o -path /sys \) -prune \
      -o -name "$soname" -print 2> /dev/null | head -1)
    [[ -n "$hit" ]] && found=$(cd "$(dirname "$hit")" && pwd -P)
  fi
  if [[ -n "$found" ]]; then
    say "     $soname: $found"
    add_path "$found"
  else
    missing="$missing $soname"
  fi
done < "$HERE/host-libs.txt"
if [[ -n "$missing" ]]; then
  result FAIL host-libraries "not found:$missing (set VP_CUDA_LIB_DIRS=dir1:dir2)" \
    "$LOGS/libraries.txt"
else
  result PASS host-libraries "$(tr '\n' ' ' < "$HERE/host-libs.txt")"
fi
# cuDNN: only VOCABPIPE_ATTENTION=cudnn opens it (the wheel PyTorch brings, nvidia/cudnn/lib);
# without it everything else runs and the cuDNN checks fail with "not found".
if [[ -s "$HERE/optional-host-libs.txt" ]]; then
  while read -r soname; do
    [[ -z "$soname" ]] && continue
    found=""
    for d in "${candidates[@]}"; do
      [[ -e "$d/$soname" ]] && { found=$(cd "$d" && pwd -P); break; }
    done
    if [[ -n "$found" ]]; then
      add_path "$found"
      result PASS "optional-library-$soname" "$found"
    else
      result INFO "optional-library-$soname" "not found: VOCABPIPE_ATTENTION=cudnn cannot run"
    fi
  done < "$HERE/optional-host-libs.txt"
fi
# The driver (cudart is linked statically and opens libcuda.so.1 at run time): its folder as
# ldconfig knows it, or the usual mounts.
libcuda=$(ldconfig -p 2> /dev/null | awk '/libcuda\.so\.1 / { print $NF; exit }')
for d in ${libcuda:+"$(dirname "$libcuda")"} /usr/local/nvidia/lib64 /usr/local/nvidia/lib \
  /usr/lib/x86_64-linux-gnu /usr/lib64; do
  if [[ -e "$d/libcuda.so.1" ]]; then
    say "     libcuda.so.1: $d"
    add_path "$(cd "$d" && pwd -P)"
    break
  fi
done
LIBPATH="$LIBPATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Only our executables (and the processes they start) get the path: host tools such as python3
# must keep loading the host's own libssl, libz, libstdc++.
VPENV=(env "LD_LIBRARY_PATH=$LIBPATH")
VP=("${VPENV[@]}" "$HERE/bin/vocabpipe")
say "     LD_LIBRARY_PATH=$LIBPATH (for the bundle's executables)"
check_ldd() {  # all executables; sets LDD_BAD to the unresolved libraries and versions
  : > "$LOGS/ldd.txt"
  for exe in "$HERE"/bin/* "$HERE"/tests/* "$HERE"/bench/*; do
    [[ -f "$exe" && "$exe" != *.sh && "$exe" != *.py ]] || continue
    echo "== $exe" >> "$LOGS/ldd.txt"
    "${VPENV[@]}" ldd "$exe" >> "$LOGS/ldd.txt" 2>&1
  done
  LDD_BAD=$(grep -E 'not found' "$LOGS/ldd.txt" | sort -u | tr -s ' \t\n' ' ')
}
check_ldd
# The bundled libstdc++/libgcc_s come from the build machine (Debian 12: GLIBC_2.36); on an
# older glibc they cannot load, and the host's own (if recent enough) must serve instead.
if [[ "$LDD_BAD" == *"version"*"not found"* ]] && [[ -e "$HERE/lib/libstdc++.so.6" ]]; then
  mkdir -p "$HERE/lib-aside"
  mv "$HERE/lib/libstdc++.so.6" "$HERE/lib/libgcc_s.so.1" "$HERE/lib-aside/" 2> /dev/null
  result INFO glibc "the bundle's libstdc++ needs a newer glibc ($LDD_BAD); using the host's"
  check_ldd
fi
if [[ -n "$LDD_BAD" ]]; then
  result FAIL ldd "$LDD_BAD" "$LOGS/ldd.txt"
else
  result PASS ldd "every library of $(grep -c '^== ' "$LOGS/ldd.txt") executables found"
fi

# ---- 1c. preflight: one CUDA context, timed (module loading is eager: this is what every
# process pays at its start)
if ((!DRY)); then
  t0=$(date +%s.%N)
  capped 30 "${VPENV[@]}" "$HERE/tests/cuda_runtime_test" \
    --gtest_filter='DeviceCount.*:StreamQuery.*' > "$LOGS/preflight.log" 2>&1
  rc=$?
  secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  if ((rc == 0)) && ! grep -q "no CUDA device" "$LOGS/preflight.log"; then
    result PASS preflight "a CUDA context and a kernel in $secs s (eager module loading)"
  else
    {
      echo "== env"; env | sort
      echo "== ldconfig -p | grep -i -e cuda -e nvidia"
      ldconfig -p 2> /dev/null | grep -i -e cuda -e nvidia
      echo "== nvidia-smi -q"; nvidia-smi -q 2>&1 | head -200
      echo "== ls /dev/nvidia*"; ls -l /dev/nvidia* 2>&1
    } > "$LOGS/preflight-facts.txt"
    result FAIL preflight "CUDA sees no usable device (exit $rc, $secs s): device checks \
skipped; facts in preflight-facts.txt" "$LOGS/preflight.log"
    sed -n '1,/== nvidia-smi -q/p' "$LOGS/preflight-facts.txt" | grep -i \
      -e LD_LIBRARY -e libcuda -e CUDA_ -e NVIDIA | head -20
    DRY=1
  fi
fi

# ---- the corpus and the specs; the CPU references come with the bundle (refs/)
synth=$(make_data "${VP[@]}")
echo "$synth" > "$LOGS/synth.txt"
FLOOR=$(sed -n 's/.*entropy rate \([0-9.]*\).*/\1/p' <<< "$synth" | head -1)
if [[ -f "$HERE/refs/data.sha256" ]]; then
  if [[ "$(sha256sum "$WORK/gpu-data.bin" | cut -d' ' -f1)" == "$(cat "$HERE/refs/data.sha256")" ]]
  then
    result PASS corpus "the same tokens as the CPU references' (sha256)"
  else
    result FAIL corpus "the synthesized corpus differs from the CPU references'" "$LOGS/synth.txt"
  fi
else
  result FAIL corpus "the bundle has no refs/ (CPU references)"
fi
cd "$WORK" || exit 1  # the specs name runs/NAME and gpu-data.bin relative to here

# ---- the test executables
run_test() {  # NAME CAP [TAG]: the log and XML are NAME[-TAG].log/.xml, the check NAME[-TAG]
  local name=$1 cap=$2 rc t0=$SECONDS passed skipped failed detail
  local check="$1${3:+-$3}" log="$LOGS/$1${3:+-$3}.log"
  if [[ ! -x "$HERE/tests/$name" ]]; then
    result FAIL "$check" "not in the bundle"
    return
  fi
  capped "$cap" "${VPENV[@]}" "$HERE/tests/$name" --gtest_output="xml:$LOGS/$check.xml" \
    > "$log" 2>&1
  rc=$?
  passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$log" | tail -1)
  skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$log" | tail -1)
  failed=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' "$log" | tail -1)
  detail="${passed:-0} passed, ${skipped:-0} skipped, ${failed:-0} failed, $((SECONDS - t0)) s"
  if ((rc == NOT_RUN)); then
    not_started "$check"
  elif ((rc == 124 || rc == 137)); then
    result FAIL "$check" "timed out ($detail; last: $(tail -1 "$log"))" "$log"
  elif ((rc != 0)); then
    result FAIL "$check" "exit $rc ($detail; $(grep -m3 '^\[  FAILED  \] [A-Z]' "$log" |
      sed 's/^\[  FAILED  \] //' | tr '\n' ' '))" "$log"
  elif ((!DRY)) && grep -q "no CUDA device" "$log"; then
    result FAIL "$check" "skipped its device tests although the preflight saw a GPU ($detail)" "$log"
  else
    result PASS "$check" "$detail"
  fi
}

# ---- end-to-end jobs on the GPU
keep_run() {  # NAME: metrics and logs of runs/NAME into the logs
  local src="$WORK/runs/$1"
  [[ -d "$src" ]] || return 0
  mkdir -p "$LOGS/runs/$1"
  cp "$src"/metrics.jsonl "$src"/*.log "$LOGS/runs/$1/" 2> /dev/null
  return 0
}
run_job() {  # NAME CAP: `vocabpipe run` through the control plane, as a user runs it
  local n=$1 cap=$2 t0=$SECONDS rc log="$LOGS/e2e-$1.log"
  capped "$cap" "${VP[@]}" run "$WORK/$n.yaml" > "$log" 2>&1
  rc=$?
  keep_run "$n"
  if ((rc == 0)); then
    result PASS "e2e-$n" "$(grep -m1 '^done:' "$log"), $((SECONDS - t0)) s"
    return
  fi
  if ((rc == NOT_RUN)); then
    not_started "e2e-$n"
    return
  fi
  result FAIL "e2e-$n" "exit $rc after $((SECONDS - t0)) s: $(tail -1 "$log")" "$log"
  local rank_log
  for rank_log in "$WORK/runs/$n"/*.log; do
    [[ -f "$rank_log" ]] && grep -qiE 'error|fail|what\(\)' "$rank_log" && FAIL_LOGS+=("$rank_log")
  done
  # A job that never left PENDING is a placement failure: --direct would only repeat the
  # device part. Otherwise, without the control plane (rank processes started directly), to
  # tell a device failure from a control-plane one.
  if grep -q "waiting for" "$log" && ! grep -q "RUNNING" "$log"; then return; fi
  sed -e "s#runs/$n,#runs/$n-direct,#" "$WORK/$n.yaml" > "$WORK/$n-direct.yaml"
  capped "$((cap * 2 / 3))" "${VP[@]}" run --direct "$WORK/$n-direct.yaml" \
    > "$LOGS/e2e-$n-direct.log" 2>&1
  rc=$?
  keep_run "$n-direct"
  result INFO "e2e-$n --direct" "exit $rc: $(tail -1 "$LOGS/e2e-$n-direct.log")"
}

# gtest_passed LOG PREFIX...: the test binary ran to its end in LOG (its output; a crash or a
# time cap leaves no closing line, and cases it never reached leave no FAILED line either) and
# every PREFIX's cases that started there passed: as many OK lines as RUN lines, at least one.
gtest_passed() {
  local log=$1 prefix runs oks
  shift
  [[ -f "$log" ]] || return 1
  grep -qE '^\[==========\] [0-9]+ tests? from [0-9]+ test (suite|case)s? ran\.' "$log" || return 1
  for prefix in "$@"; do
    runs=$(grep -cF "[ RUN      ] $prefix" "$log")
    oks=$(grep -cF "[       OK ] $prefix" "$log")
    ((runs >= 1 && oks == runs)) || return 1
    grep -qF "[  FAILED  ] $prefix" "$log" && return 1
  done
  return 0
}
# gated_refused NAME: validation still refuses NAME's spec on cuda until its GPU tests pass
# (`vocabpipe plan` validates offline in a moment); its exit status in VALIDATION_RC, its output
# in e2e-NAME-validation.log.
gated_refused() {
  local log="$LOGS/e2e-$1-validation.log"
  capped 20 "${VP[@]}" plan "$WORK/$1.yaml" > "$log" 2>&1
  VALIDATION_RC=$?
  ((VALIDATION_RC == 2)) && grep -q "has not run on a GPU yet" "$log"
}
# run_gated_job NAME PATH CAP TEST_LOG PREFIX...: run_job for a spec that validation refuses on
# cuda until the path's GPU tests pass (PATH data or tensor: a rule of proto/spec/job_spec.cc).
# While the rule stands: when those tests (PREFIX... in TEST_LOG) passed in this run, the job
# runs with VOCABPIPE_UNVERIFIED_CUDA=PATH (the operator's switch that accepts the path), so one
# command both tests the path and runs it end to end; else a SKIP naming the rule. After the rule
# is lifted, the job as any other.
run_gated_job() {
  local n=$1 path=$2 cap=$3 test_log=$4
  shift 4
  if gated_refused "$n"; then
    if ! gtest_passed "$test_log" "$@"; then
      result SKIP "e2e-$n" "refused at submit, and its GPU tests did not all pass here: $*"
      return
    fi
    say "     $n: its GPU tests passed above; run with VOCABPIPE_UNVERIFIED_CUDA=$path"
    VOCABPIPE_UNVERIFIED_CUDA=$path run_job "$n" "$cap"
    return
  fi
  run_job "$n" "$cap"
}

# run_opt_in VALUE VAR [LABEL [CAP_SCALE]]: the layer stacks (GPT-2 and Llama) and the 200-step
# bf16 job (as gpu-p1-bf16-LABEL, which compare.py checks like gpu-p1-bf16) with VAR=VALUE, an
# opt-in kernel set; LABEL defaults to VALUE; CAP_SCALE (1) multiplies both time caps (cuDNN
# plans each new shape once, compiling its kernels at first use).
run_opt_in() {
  local value=$1 var=$2 label=${3:-$1} scale=${4:-1}
  say "== $var=$value"
  export "$var=$value"
  run_test cuda_layer_stack_test $((45 * scale)) "$label"
  sed -e "s#runs/gpu-p1-bf16,#runs/gpu-p1-bf16-$label,#" \
    -e "s/^name: .*/name: gpu-p1-bf16-$label/" "$WORK/gpu-p1-bf16.yaml" \
    > "$WORK/gpu-p1-bf16-$label.yaml"
  run_job "gpu-p1-bf16-$label" $((60 * scale))
  unset "$var"
}

if ((PERF_ONLY)); then
  result SKIP tests-and-jobs "VP_GPU_ONLY=perf"
else
  if ((DRY)); then
    say "== tests (device-free parts)"
    for t in cuda_library_loading_test cuda_runtime_test cuda_kernels_test cuda_pipeline_test \
      cuda_layer_stack_test cuda_vocab_shards_test cuda_nccl_test cuda_parallel_linear_test; do
      run_test "$t" 120
    done
    say "== end-to-end"
    capped 60 "${VP[@]}" run "$WORK/gpu-p1-fp32.yaml" > "$LOGS/e2e-gpu-p1-fp32.log" 2>&1
    rc=$?
    if ((rc == 2)) && grep -q "device: cuda" "$LOGS/e2e-gpu-p1-fp32.log"; then
      result PASS e2e-refused-without-gpu "$(tail -1 "$LOGS/e2e-gpu-p1-fp32.log")"
    else
      result FAIL e2e-refused-without-gpu "exit $rc: $(tail -1 "$LOGS/e2e-gpu-p1-fp32.log")" \
        "$LOGS/e2e-gpu-p1-fp32.log"
    fi
    # The gated jobs: refused at submit while their rule stands (SKIP), or valid (PASS).
    for n in gpu-d2-p2 gpu-t2-p2; do
      if gated_refused "$n"; then
        result SKIP "e2e-$n" "refused at submit until its GPU tests pass"
      elif ((VALIDATION_RC == 0)); then
        result PASS "e2e-$n-validation" "accepted (its rule is lifted)"
      else
        result FAIL "e2e-$n-validation" \
          "exit $VALIDATION_RC: $(tail -1 "$LOGS/e2e-$n-validation.log")" "$LOGS/e2e-$n-validation.log"
      fi
    done
  else
    say "== tests and jobs, in order of value"
    # First: cuBLASLt and NCCL are opened at run time, so ldd cannot vouch for them; this opens
    # the host's copies and binds every function the backend calls.
    run_test cuda_library_loading_test 20
    run_test cuda_runtime_test 30
    run_test cuda_kernels_test 90
    # cuDNN's attention is the one path written without ever running it: if its test failed,
    # run it again alone with cuDNN's own log (errors and warnings: which engine refused the
    # graph and why), cut to 2 MB.
    if grep -q '^\[  FAILED  \] CudaCudnnAttention.MatchesCpu' \
      "$LOGS/cuda_kernels_test.log" 2> /dev/null; then
      capped 40 env CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG="$LOGS/cudnn-debug.log" "${VPENV[@]}" \
        "$HERE/tests/cuda_kernels_test" --gtest_filter=CudaCudnnAttention.MatchesCpu \
        > "$LOGS/cuda_kernels_test-cudnn.log" 2>&1
      truncate -s '<2M' "$LOGS/cudnn-debug.log" 2> /dev/null
      result INFO cudnn-debug "the cuDNN attention test again with cuDNN's log: cudnn-debug.log"
    fi
    run_job gpu-p1-fp32 75
    run_test cuda_pipeline_test 150
    run_job gpu-p1-bf16 60
    run_job gpu-p2-vocab1 45
    run_job gpu-p2-vocab2 45
    run_test cuda_layer_stack_test 45
    run_test cuda_vocab_shards_test 45
    run_job gpu-llama-p2 45
    run_test cuda_nccl_test 30
    run_test cuda_parallel_linear_test 30
    # Data 2 × pipeline 2 (ZeRO-1) and tensor 2 × pipeline 2, four ranks on the one GPU: fp32
    # against their CPU references; gpu-t2-p2 beside gpu-p2-vocab2 (the same job at t = 1) gives
    # tokens/s and memory per rank at t = 1 and 2 on one card. Each runs once its
    # cuda_pipeline_test cases (d = 2 replicas; t = 2 tensor ranks) have passed above.
    run_gated_job gpu-d2-p2 data 60 "$LOGS/cuda_pipeline_test.log" Replicas/CudaDataParallel
    run_gated_job gpu-t2-p2 tensor 60 "$LOGS/cuda_pipeline_test.log" TensorRanks/CudaDataParallel
    # The opt-in kernels, each until it passes here (cuda_kernels_test checks every kernel set
    # explicitly; the tensor-core and FMA attention kernels passed these end-to-end checks in runs
    # 2-4, the bias epilogue alone in runs 3-4): the pipelined flash attention kernels (cp.async
    # double buffering, ldmatrix operands) and the wide ones (their backward, a forward of 32 query
    # rows per warp) beside the default flash ones; the 16-byte memory-bound kernels (norms, GELU,
    # SwiGLU, residual, bias, softmax rows, AdamW); the cuBLASLt bias and GELU epilogues.
    # First the library attention: cuDNN's fused kernels (cuda_kernels_test's
    # CudaCudnnAttention.MatchesCpu has checked them against the CPU above).
    run_opt_in cudnn VOCABPIPE_ATTENTION cudnn 2
    run_opt_in flash-pipelined VOCABPIPE_ATTENTION
    run_opt_in flash-wide VOCABPIPE_ATTENTION
    run_opt_in vector VOCABPIPE_MEMORY_KERNELS
    run_opt_in all VOCABPIPE_GEMM_EPILOGUE epilogues
  fi
fi

# ---- the benchmarks
pack
RESERVE=0
say "== benchmarks ($(left) s left)"
if [[ -x "$HERE/bench/perf.sh" ]]; then
  perf_args=("$LOGS/perf")
  ((DRY)) && perf_args=(--dry-run "${perf_args[@]}")
  export VP_BIN_ENV="${VPENV[*]}"  # perf.sh's prefix for our binaries; python3 runs plain
  # perf.sh plans its variants within its own budget: give it what the cap will allow, so it
  # skips variants rather than being killed before it writes the table.
  perf_budget=$(($(left) - 25))
  ((perf_budget > 165)) && perf_budget=165
  ((perf_budget < 10)) && perf_budget=10
  PERF_BUDGET_S=$perf_budget capped 180 bash "$HERE/bench/perf.sh" "${perf_args[@]}" \
    > "$LOGS/perf.log" 2>&1
  rc=$?
  [[ -f "$LOGS/perf/perf.txt" ]] && cp "$LOGS/perf/perf.txt" "$LOGDIR/perf.txt"
  if ((rc == NOT_RUN)); then
    not_started perf
  elif ((rc == 0)); then
    result "$( ((DRY)) && echo SKIP || echo PASS)" perf "$(tail -1 "$LOGS/perf.log")"
    [[ -f "$LOGDIR/perf.txt" ]] && sed 's/^/     /' "$LOGDIR/perf.txt" | tee -a "$SUMMARY"
  else
    result FAIL perf "exit $rc: $(tail -1 "$LOGS/perf.log")" "$LOGS/perf.log"
  fi
fi
# The bare kernels and sections (attention TFLOP/s, every memory-bound kernel alone) after
# perf.sh's table, which the issue's acceptance reads.
: > "$LOGS/cuda_bench.txt"
((PERF_ONLY)) || capped 45 "${VPENV[@]}" "$HERE/bench/cuda_bench" > "$LOGS/cuda_bench.txt" 2>&1
rc=$?
if ((PERF_ONLY)); then
  result SKIP cuda_bench "VP_GPU_ONLY=perf"
elif ((rc == NOT_RUN)); then
  not_started cuda_bench
elif ((rc == 0)) && ((!DRY)) && grep -q "no CUDA device" "$LOGS/cuda_bench.txt"; then
  result FAIL cuda_bench "CUDA sees no device although the preflight did" "$LOGS/cuda_bench.txt"
elif ((rc == 0)); then
  result "$( ((DRY)) && echo SKIP || echo PASS)" cuda_bench \
    "$(grep -c . "$LOGS/cuda_bench.txt") lines ($(head -1 "$LOGS/cuda_bench.txt"))"
  ((DRY)) || grep -E 'MFU|TFLOP' "$LOGS/cuda_bench.txt" | head -20 | sed 's/^/     /' | tee -a "$SUMMARY"
else
  result FAIL cuda_bench "exit $rc: $(tail -1 "$LOGS/cuda_bench.txt")" "$LOGS/cuda_bench.txt"
fi
pack
# Nsight Compute on the layer's hand-written kernels (flash attention, norms), default and
# opt-in sets: why each is slow (stall reasons, occupancy, bank conflicts). Last: the least
# needed; skipped where ncu is missing or under 40 s are left.
if [[ -x "$HERE/bench/kernel_profile.sh" ]]; then
  kp_args=("$LOGS/ncu")
  ((DRY)) && kp_args=(--dry-run "${kp_args[@]}")
  if ((!DRY)) && (($(left) < 40)); then
    result SKIP kernel-profile "$(left) s left"
  else
    capped 90 bash "$HERE/bench/kernel_profile.sh" "${kp_args[@]}" > "$LOGS/kernel_profile.log" 2>&1
    rc=$?
    if ((rc == 0)); then
      result "$( ((DRY)) && echo SKIP || echo PASS)" kernel-profile \
        "$(grep -c . "$LOGS/kernel_profile.log") lines (ncu/ncu-summary.txt in logs.tgz)"
      ((DRY)) || sed 's/^/     /' "$LOGS/ncu/ncu-summary.txt" | head -80 | tee -a "$SUMMARY"
    else
      result FAIL kernel-profile "exit $rc: $(tail -1 "$LOGS/kernel_profile.log")" \
        "$LOGS/kernel_profile.log"
    fi
  fi
fi

# ---- the comparison with the CPU references
if ((PERF_ONLY)); then
  finish
  ((FAILS == 0))
  exit
fi
say "== comparison"
compare_args=("$LOGS/runs" --refs "$HERE/refs" --cpu-steps "$REF_STEPS")
[[ -n "$FLOOR" ]] && compare_args+=(--floor "$FLOOR")
((DRY)) && compare_args+=(--cpu-only)
if command -v python3 > /dev/null; then
  python3 "$HERE/compare.py" "${compare_args[@]}" > "$LOGS/compare.txt" 2>&1
  while read -r verdict rest; do
    case "$verdict" in
      PASS | INFO | SKIP) result "$verdict" "$rest" ;;
      FAIL) result FAIL "$rest" "" "$LOGS/compare.txt" ;;
    esac
  done < "$LOGS/compare.txt"
else
  result FAIL compare "no python3 on this host"
fi

finish
((FAILS == 0))
