#!/usr/bin/env bash
# gpu-bundle.sh: everything a GPU host needs to run the CUDA checks, in one folder under 64 MiB.
#
#   scripts/gpu-bundle.sh            (or: make gpu-bundle)   here, on the build machine
#   bash gpu-bundle/run.sh LOGDIR                             there, on the GPU host
#
# Builds with VOCABPIPE_CUDA=ON (cudart linked statically, cmake/cuda.cmake), then packs into
# gpu-bundle/vocabpipe-gpu.tar.xz: the programs (vocabpipe, vocabpipe-worker,
# vocabpipe-coordinator), every CUDA test executable, cuda_bench and the performance baseline
# (bench/cuda/perf.sh, torch_baseline.py) and the kernel profiler (bench/cuda/kernel_profile.sh), the example specs of the end-to-end checks, the
# comparator, the CPU reference runs (refs/: made here by run.sh --make-references, so the GPU
# host spends no time on them), and every shared library they load except
#   - glibc (libc, libm, libpthread, libdl, librt, ld-linux, ...): the host's is newer, and
#     binaries built against an older glibc run on a newer one;
#   - the CUDA driver (libcuda) and cuBLASLt, NCCL: hundreds of MiB; the host has them (its CUDA
#     toolkit, its Python environment's nvidia-* packages). Their sonames are listed in
#     host-libs.txt (the backend opens them at run time, so they come from the build's
#     cuda-libraries.txt, not from ldd), and run.sh puts their folders on LD_LIBRARY_PATH.
# Binaries and libraries are stripped (--strip-unneeded). gpu-bundle/run.sh unpacks the archive
# into a temporary folder and runs its run.sh (scripts/gpu-run.sh) with LD_LIBRARY_PATH set.
#
# Then it proves the bundle self-contained on this machine: unpacked in a temporary folder,
# `ldd` of every executable resolves each library to the bundle's lib/, to glibc, or to a host
# CUDA library (nothing else, nothing "not found"), and run.sh --dry-run runs everything that
# needs no GPU (the CPU tests, the device-free parts of the CUDA tests, the CPU reference jobs)
# with only the bundle's lib/ and the CUDA library folders on LD_LIBRARY_PATH.
#
# Environment: BUILD_DIR (build), BUNDLE_DIR (gpu-bundle), JOBS (nproc), SKIP_BUILD=1 (pack an
# existing build), SKIP_CHECK=1 (no proof run).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD_DIR=${BUILD_DIR:-build}
BUNDLE_DIR=${BUNDLE_DIR:-gpu-bundle}
JOBS=${JOBS:-$(nproc)}
MAX_BYTES=$((64 * 1024 * 1024))

PROGRAMS=(client/vocabpipe worker/main/vocabpipe-worker
          coordinator/server/vocabpipe-coordinator)
CUDA_TESTS=(tests/unit/cuda/cuda_library_loading_test tests/unit/cuda/cuda_runtime_test tests/unit/cuda/cuda_kernels_test
            tests/unit/cuda_layers/cuda_layer_stack_test tests/unit/cuda_layers/cuda_parallel_linear_test
            tests/unit/cuda_vocab/cuda_vocab_shards_test
            tests/integration/cuda_pipeline/cuda_pipeline_test tests/unit/cuda/cuda_nccl_test)
BENCHES=(bench/cuda/cuda_bench)
# The performance baseline's scripts (when present), beside cuda_bench in bench/.
BENCH_SCRIPTS=(bench/cuda/perf.sh bench/cuda/torch_baseline.py bench/cuda/kernel_profile.sh
  bench/cuda/bench_common.sh)

if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  launcher=()
  # ccache only for a fresh build folder: changing the launcher of a configured one would
  # recompile everything.
  if [[ ! -f "$BUILD_DIR/CMakeCache.txt" ]] && command -v ccache > /dev/null; then
    launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  fi
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DVOCABPIPE_CUDA=ON \
    "${launcher[@]}" > /dev/null
  targets=()
  for t in "${PROGRAMS[@]}" "${CUDA_TESTS[@]}" "${BENCHES[@]}"; do
    targets+=("$(basename "$t")")
  done
  cmake --build "$BUILD_DIR" -j "$JOBS" --target "${targets[@]}"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
stage="$work/vocabpipe-gpu"
mkdir -p "$stage"/{bin,tests,bench,lib,examples}

# A library is glibc's, the CUDA driver's or a host CUDA library's (not bundled), else bundled.
classify() {
  case "${1##*/}" in
    linux-vdso.so* | ld-linux*.so* | libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | \
      librt.so.* | libresolv.so.* | libutil.so.* | libnsl.so.* | libanl.so.* | libBrokenLocale.so.*)
      echo glibc ;;
    libcuda.so.* | libnvidia-*.so*) echo driver ;;
    libcudart.so.* | libcublas.so.* | libcublasLt.so.* | libnccl.so.*) echo host-cuda ;;
    *) echo bundle ;;
  esac
}

copy_exe() {  # build-relative path, destination folder
  local src="$BUILD_DIR/$1"
  [[ -x "$src" ]] || { echo "gpu-bundle: $src was not built" >&2; exit 1; }
  cp "$src" "$stage/$2/"
  strip --strip-unneeded "$stage/$2/$(basename "$1")"
}
for p in "${PROGRAMS[@]}"; do copy_exe "$p" bin; done
for t in "${CUDA_TESTS[@]}"; do copy_exe "$t" tests; done
for b in "${BENCHES[@]}"; do copy_exe "$b" bench; done
for b in "${BENCH_SCRIPTS[@]}"; do
  if [[ -f "$b" ]]; then cp "$b" "$stage/bench/"; fi
done

# Every library any executable loads (ldd lists the whole closure).
declare -A host_libs=()
for exe in "$stage"/bin/* "$stage"/tests/* "$stage"/bench/*; do
  [[ "$exe" == *.sh || "$exe" == *.py ]] && continue
  while read -r name path; do
    case "$(classify "$name")" in
      bundle)
        [[ -e "$path" ]] || { echo "gpu-bundle: $exe needs $name: not found here" >&2; exit 1; }
        if [[ ! -e "$stage/lib/$name" ]]; then
          cp -L "$path" "$stage/lib/$name"
          chmod u+w "$stage/lib/$name"
          strip --strip-unneeded "$stage/lib/$name"
        fi ;;
      host-cuda) host_libs[$name]=1 ;;
    esac
  done < <(ldd "$exe" | awk '$2 == "=>" { print $1, $3 } $2 != "=>" && $1 ~ /\.so/ { print $1, $1 }')
done
# cuBLASLt and NCCL are opened at run time (dlopen), so ldd does not list them: the build names
# them in cuda-libraries.txt (cmake/cuda.cmake).
[[ -f "$BUILD_DIR/cuda-libraries.txt" ]] ||
  { echo "gpu-bundle: $BUILD_DIR/cuda-libraries.txt is missing (not a CUDA build?)" >&2; exit 1; }
while read -r name; do
  [[ -n "$name" ]] && host_libs[$name]=1
done < "$BUILD_DIR/cuda-libraries.txt"
printf '%s\n' "${!host_libs[@]}" | sort > "$stage/host-libs.txt"
# cuDNN (VOCABPIPE_ATTENTION=cudnn only) is looked for too, but a host without it still runs.
if [[ -f "$BUILD_DIR/cuda-optional-libraries.txt" ]]; then
  cp "$BUILD_DIR/cuda-optional-libraries.txt" "$stage/optional-host-libs.txt"
else
  : > "$stage/optional-host-libs.txt"
fi

cp scripts/gpu-run.sh "$stage/run.sh"
cp scripts/gpu_compare.py "$stage/compare.py"
cp examples/gpu-*.yaml "$stage/examples/"
chmod +x "$stage/run.sh"
# The CPU references (20 steps of each fp32 job on the CPU), with the staged programs.
echo "gpu-bundle: the CPU reference runs (refs/)"
env LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
  bash "$stage/run.sh" --make-references "$stage/refs"
{
  echo "vocabpipe GPU bundle"
  echo "built:   $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(ldd --version | head -1)"
  echo "source:  $(git -C "$ROOT" rev-parse --short HEAD 2> /dev/null || echo unknown)$(
    git -C "$ROOT" diff --quiet HEAD 2> /dev/null || echo ' (with uncommitted changes)')"
  nvcc=$(sed -n 's/^CMAKE_CUDA_COMPILER:[A-Z]*=//p' "$BUILD_DIR/CMakeCache.txt")
  echo "nvcc:    $("$nvcc" --version 2> /dev/null | grep -o 'release [0-9.]*, V[0-9.]*' || true)"
  echo "archs:   $(grep -o 'CMAKE_CUDA_ARCHITECTURES:[A-Z]*=.*' "$BUILD_DIR/CMakeCache.txt" \
                     | cut -d= -f2)"
  echo "host libraries (found by run.sh on the GPU host): $(tr '\n' ' ' < "$stage/host-libs.txt")"
} > "$stage/MANIFEST"

raw=$(du -sb "$stage" | cut -f1)
rm -rf "$BUNDLE_DIR"
mkdir -p "$BUNDLE_DIR"
tar -C "$work" -cf - vocabpipe-gpu | xz -T"$JOBS" -6 > "$BUNDLE_DIR/vocabpipe-gpu.tar.xz"
cat > "$BUNDLE_DIR/run.sh" << 'EOF'
#!/usr/bin/env bash
# Unpacks vocabpipe-gpu.tar.xz beside a temporary folder and runs its run.sh (all arguments
# passed on: [--dry-run] LOGDIR). Made by scripts/gpu-bundle.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=$(mktemp -d "${TMPDIR:-/tmp}/vocabpipe-gpu.XXXXXX")
if command -v xz > /dev/null; then
  tar -C "$dest" -xJf "$here/vocabpipe-gpu.tar.xz"
else  # no xz-utils on the host: Python's tarfile reads xz (lzma) itself
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
    "$here/vocabpipe-gpu.tar.xz" "$dest"
fi
exec bash "$dest/vocabpipe-gpu/run.sh" "$@"
EOF
chmod +x "$BUNDLE_DIR/run.sh"
packed=$(du -cb "$BUNDLE_DIR"/* | tail -1 | cut -f1)
echo "gpu-bundle: $(find "$stage" -type f | wc -l) files, $((raw / 1048576)) MiB stripped," \
  "$((packed / 1048576)) MiB packed ($packed bytes) in $BUNDLE_DIR/"
echo "gpu-bundle: host libraries: $(tr '\n' ' ' < "$stage/host-libs.txt")"
if ((packed > MAX_BYTES)); then
  echo "gpu-bundle: over the 64 MiB limit" >&2
  exit 1
fi

[[ "${SKIP_CHECK:-0}" == 1 ]] && exit 0

# The proof: a fresh unpack, ldd with only the bundle's lib/ (and the CUDA folders) on the path,
# then the dry run.
check="$work/check"
mkdir -p "$check"
tar -C "$check" -xJf "$BUNDLE_DIR/vocabpipe-gpu.tar.xz"
lib="$check/vocabpipe-gpu/lib"
cuda_dirs=/usr/local/cuda/lib64
bad=0
for exe in "$check"/vocabpipe-gpu/{bin,tests,bench}/*; do
  [[ "$exe" == *.sh || "$exe" == *.py ]] && continue
  while read -r name path; do
    kind=$(classify "$name")
    if [[ "$path" == "not" ]]; then
      echo "gpu-bundle: $(basename "$exe"): $name not found" >&2
      bad=1
    elif [[ "$kind" == bundle && "$path" != "$lib/"* ]]; then
      echo "gpu-bundle: $(basename "$exe"): $name resolved outside the bundle: $path" >&2
      bad=1
    fi
  done < <(env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="$lib:$cuda_dirs" ldd "$exe" |
           awk '$2 == "=>" { print $1, $3 }')
done
((bad == 0)) || exit 1
echo "gpu-bundle: ldd: every library resolves to the bundle, glibc or the CUDA libraries"
logs="${CHECK_LOGS:-$BUNDLE_DIR-check}"
rm -rf "$logs"
env -i PATH=/usr/bin:/bin HOME="${HOME:-/root}" TMPDIR="${TMPDIR:-/tmp}" \
  bash "$check/vocabpipe-gpu/run.sh" --dry-run "$logs"
