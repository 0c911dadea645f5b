#!/usr/bin/env bash
# Installs vocabpipe's build and test dependencies from Debian packages. Idempotent: packages
# already present are not fetched again, so `make test` can call it every time.
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config ninja-build ccache
  protobuf-compiler libprotobuf-dev protobuf-compiler-grpc libgrpc++-dev libabsl-dev
  libgloo-dev libopenblas-openmp-dev libyaml-cpp-dev nlohmann-json3-dev libsqlite3-dev
  libgtest-dev libgmock-dev libbenchmark-dev libsentencepiece-dev libssl-dev
  python3-torch python3-numpy
  # the charts of bench/paper (paper_charts.py) and of docs/img's loss curves
  python3-matplotlib
  prometheus-cpp-dev prometheus
  clang-14 libclang-rt-14-dev
  # make demo-text's corpus: the King James Bible (bible-kjv-text) and its reader `bible`
  bible-kjv
  # deploy tests (tests/deploy): network namespaces, a local Slurm, the k8s validator
  iproute2 util-linux slurm-wlm munge nodejs
)
# npm: Debian's package, unless a nodejs that bundles npm is installed already.
command -v npm >/dev/null || PACKAGES+=(npm)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

# The k8s manifest validator's npm packages (versions pinned in package-lock.json).
install_k8s_validator() {
  local dir
  dir="$(cd "$(dirname "$0")/.." && pwd)/tests/deploy/k8s"
  if [ -f "$dir/package-lock.json" ] && [ ! -d "$dir/node_modules/kubernetes-models" ] &&
    command -v npm >/dev/null; then
    echo "setup: npm ci in $dir"
    npm ci --prefix "$dir" --no-audit --no-fund --silent
  fi
}

if [ ${#missing[@]} -eq 0 ]; then
  install_k8s_validator
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
install_k8s_validator
