#!/usr/bin/env bash
# The compiler launcher `make configure` gives CMake (C++ and CUDA): compile.sh COMPILER ARGS...
#  - runs the compile through ccache when ccache is on PATH at compile time, so the configure
#    line (and with it every compile command ninja compares) is the same before and after
#    scripts/setup.sh installs ccache: `make demo` then `make test` rebuild nothing;
#  - keeps the compiler's messages for the object it makes in OBJ.warnings (empty when clean),
#    which scripts/check_warnings.sh reads (`make test` fails on a compiler warning). A compile
#    that ccache answers from its cache replays the messages, so they are kept then too.
# The messages still reach the terminal, after the compile; the exit status is the compiler's.
set -u
obj=""
prev=""
for a in "$@"; do
  if [ "$prev" = "-o" ]; then obj="$a"; fi
  prev="$a"
done
launcher=()
if [ -z "${VOCABPIPE_NO_CCACHE:-}" ] && command -v ccache >/dev/null 2>&1; then launcher=(ccache); fi
if [ -z "$obj" ]; then exec "${launcher[@]}" "$@"; fi
log="$obj.warnings"
mkdir -p "$(dirname "$log")"
"${launcher[@]}" "$@" 2>"$log"
rc=$?
cat "$log" >&2
exit $rc
