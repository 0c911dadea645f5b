# shellcheck shell=bash disable=SC2034  # sets variables for the script that sources it
# Sourced by bench/cuda/perf.sh and bench/cuda/kernel_profile.sh (they travel together in the GPU
# bundle's bench/): the options both take and how both find and start their programs.

# parse_bench_options NAME USAGE QUICK_ALLOWED ARGS...: [--dry-run] [--quick] [-h] OUTDIR into
# dry_run, quick, outdir (made, absolute). --help prints the calling script's header comment; a
# bad option, a second OUTDIR or none exits 2 with NAME's message.
parse_bench_options() {
  local name=$1 usage=$2 quick_allowed=$3 a
  shift 3
  dry_run=0 quick=0 outdir=""
  for a in "$@"; do
    case "$a" in
      --dry-run) dry_run=1 ;;
      --quick)
        ((quick_allowed)) || {
          echo "$name: unknown option $a" >&2
          exit 2
        }
        quick=1
        ;;
      -h | --help)
        sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
      -*)
        echo "$name: unknown option $a" >&2
        exit 2
        ;;
      *)
        [[ -z "$outdir" ]] || {
          echo "$name: one OUTDIR only" >&2
          exit 2
        }
        outdir=$a
        ;;
    esac
  done
  [[ -n "$outdir" ]] || {
    echo "usage: $usage" >&2
    exit 2
  }
  mkdir -p "$outdir" || exit 2
  outdir=$(cd "$outdir" && pwd)
}

# bench_programs HERE: bin_env (VP_BIN_ENV split on spaces: the prefix for our binaries), python
# (PYTHON, else python3), py_env (python3 with LD_LIBRARY_PATH=$VP_HOST_LD_LIBRARY_PATH when that
# is set, unset when it is empty) and bench (cuda_bench: CUDA_BENCH, else beside HERE, else the
# build-cuda/ or build/ tree HERE sits in; empty when none).
bench_programs() {
  local here=$1 c
  read -r -a bin_env <<< "${VP_BIN_ENV:-}"
  python=${PYTHON:-python3}
  py_env=()
  if [[ -n "${VP_HOST_LD_LIBRARY_PATH+x}" ]]; then
    if [[ -n "$VP_HOST_LD_LIBRARY_PATH" ]]; then
      py_env=(env "LD_LIBRARY_PATH=$VP_HOST_LD_LIBRARY_PATH")
    else
      py_env=(env -u LD_LIBRARY_PATH)
    fi
  fi
  bench=${CUDA_BENCH:-}
  if [[ -z "$bench" ]]; then
    for c in "$here/cuda_bench" "$here/../../build-cuda/bench/cuda/cuda_bench" \
      "$here/../../build/bench/cuda/cuda_bench"; do
      if [[ -x "$c" ]]; then
        bench=$c
        break
      fi
    done
  fi
}
