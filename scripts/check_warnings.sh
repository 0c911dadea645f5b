#!/usr/bin/env bash
# check_warnings.sh BUILD_DIR: fails (exit 1) when a compile of BUILD_DIR printed a compiler
# warning, naming each one. It reads OBJ.warnings, the messages scripts/compile.sh keeps for
# every object it compiles (each rebuilt object replaces its own file), so the answer covers
# the whole tree as last built, not just what the latest build recompiled.
#   check_warnings.sh --self-test: compiles a file with a warning through compile.sh into a
#   scratch build folder and checks that the check fails on it and passes on a clean file.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

check() {
  local dir="$1"
  if [ ! -d "$dir" ]; then
    echo "check_warnings: $dir: no such build folder" >&2
    return 2
  fi
  local logs
  logs="$(find "$dir" -name '*.warnings' -type f -size +0c 2>/dev/null | sort)"
  if [ -z "$(find "$dir" -name '*.warnings' -type f -print -quit 2>/dev/null)" ]; then
    echo "check_warnings: $dir has no compiler logs (configure with" \
      "-DCMAKE_CXX_COMPILER_LAUNCHER=$here/compile.sh, as make configure does)" >&2
    return 2
  fi
  local found=0
  local f
  for f in $logs; do
    if grep -q 'warning' "$f"; then
      found=$((found + 1))
      echo "--- ${f%.warnings}" >&2
      grep -E 'warning' "$f" >&2 || true
    fi
  done
  if [ "$found" -gt 0 ]; then
    echo "check_warnings: $found object(s) compiled with warnings (a clean build prints none)" >&2
    return 1
  fi
  echo "check_warnings: no compiler warnings in $dir"
}

self_test() {
  local tmp
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' RETURN
  mkdir -p "$tmp/build/obj"
  printf 'int f() { int unused = 1; return 0; }\n' >"$tmp/warn.cc"
  printf 'int g() { return 0; }\n' >"$tmp/clean.cc"
  (cd "$tmp/build" && VOCABPIPE_NO_CCACHE=1 bash "$here/compile.sh" c++ -Wall -c ../clean.cc \
    -o obj/clean.o 2>/dev/null)
  if ! check "$tmp/build" >/dev/null 2>&1; then
    echo "self-test: a clean object was reported" >&2
    return 1
  fi
  (cd "$tmp/build" && VOCABPIPE_NO_CCACHE=1 bash "$here/compile.sh" c++ -Wall -c ../warn.cc \
    -o obj/warn.o 2>/dev/null)
  if check "$tmp/build" >/dev/null 2>&1; then
    echo "self-test: a warning was not reported" >&2
    return 1
  fi
  # Rebuilt without the warning, the object's log is replaced and the check passes again.
  printf 'int f() { return 0; }\n' >"$tmp/warn.cc"
  (cd "$tmp/build" && VOCABPIPE_NO_CCACHE=1 bash "$here/compile.sh" c++ -Wall -c ../warn.cc \
    -o obj/warn.o 2>/dev/null)
  if ! check "$tmp/build" >/dev/null 2>&1; then
    echo "self-test: a fixed warning was still reported" >&2
    return 1
  fi
  echo "check_warnings self-test: ok"
}

if [ "${1:-}" = "--self-test" ]; then
  self_test
else
  check "${1:?usage: check_warnings.sh BUILD_DIR | --self-test}"
fi
