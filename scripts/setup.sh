#!/usr/bin/env bash
# Installs vocabpipe's build and test dependencies from Debian packages. Idempotent: packages
# already present are not fetched again, so `make test` can call it every time.
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config ninja-build ccache
  protobuf-compiler libprotobuf-dev protobuf-compiler-grpc libgrpc++-dev libabsl-dev
  libgloo-dev libopenblas-dev libyaml-cpp-dev nlohmann-json3-dev libsqlite3-dev
  libgtest-dev libgmock-dev libbenchmark-dev libssl-dev
  python3-torch python3-numpy
  prometheus-cpp-dev prometheus
  clang-14 libclang-rt-14-dev
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
