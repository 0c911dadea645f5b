#!/usr/bin/env bash
# Every document of deploy/k8s validated offline: the API schemas (kubernetes-models, pinned in
# tests/deploy/k8s/package.json; scripts/setup.sh installs it) and the rules a cluster enforces
# that schemas miss (tests/deploy/k8s/validate.mjs); `kubectl kustomize` builds the CPU bundle
# and the GPU variant (workers-gpu.yaml in place of workers.yaml), both validated too. The
# validator must also reject a broken copy (so the check can fail).
set -euo pipefail
src="$(cd "$(dirname "$0")/../.." && pwd)"
k8s="$src/deploy/k8s"
validate="$src/tests/deploy/k8s/validate.mjs"
if [ ! -d "$src/tests/deploy/k8s/node_modules/kubernetes-models" ]; then
  echo "SKIP: kubernetes-models not installed (scripts/setup.sh runs npm ci in tests/deploy/k8s)"
  exit 77
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

node "$validate" "$k8s"/namespace.yaml "$k8s"/coordinator.yaml "$k8s"/workers.yaml
node "$validate" "$k8s"/namespace.yaml "$k8s"/coordinator.yaml "$k8s"/workers-gpu.yaml
# kubectl is not a Debian package: where it is missing, the kustomize builds are skipped (said).
if command -v kubectl >/dev/null; then
  kubectl kustomize "$k8s" > "$tmp/cpu.yaml"
  node "$validate" "$tmp/cpu.yaml"
  grep -q "kind: StatefulSet" "$tmp/cpu.yaml"
  mkdir "$tmp/gpu"
  sed 's/- workers.yaml/- workers-gpu.yaml/' "$k8s/kustomization.yaml" > "$tmp/gpu/kustomization.yaml"
  cp "$k8s"/namespace.yaml "$k8s"/coordinator.yaml "$k8s"/workers-gpu.yaml "$tmp/gpu/"
  kubectl kustomize "$tmp/gpu" > "$tmp/gpu.yaml"
  node "$validate" "$tmp/gpu.yaml"
  grep -q "nvidia.com/gpu: 1" "$tmp/gpu.yaml"
else
  echo "note: kubectl not installed: kustomize builds not checked"
fi

# A broken copy: selector off its labels, requests above limits, a GPU only in requests.
sed -e 's/app.kubernetes.io\/component: worker$/app.kubernetes.io\/component: wrker/;t' \
    -e 's/memory: 4Gi/memory: 64Gi/' "$k8s/workers.yaml" > "$tmp/broken.yaml"
python3 - "$tmp/broken.yaml" <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
# only the first template label breaks: replace the pod template's component label
s = s.replace("      labels:\n        app.kubernetes.io/name: vocabpipe\n        app.kubernetes.io/component: wrker",
              "      labels:\n        app.kubernetes.io/name: vocabpipe\n        app.kubernetes.io/component: other", 1)
s = s.replace("            requests:\n              cpu: \"4\"", "            requests:\n              nvidia.com/gpu: 1\n              cpu: \"4\"", 1)
open(p, "w").write(s)
PY
if node "$validate" "$k8s/namespace.yaml" "$tmp/broken.yaml" > "$tmp/broken.log"; then
  echo "FAIL: the validator accepted a broken manifest"; exit 1
fi
for want in "does not match the template's labels" "exceeds limits.memory" "must be in limits"; do
  grep -q "$want" "$tmp/broken.log" || { echo "FAIL: not reported: $want"; cat "$tmp/broken.log"; exit 1; }
done
# A NetworkPolicy admitting a namespace the manifests do not create.
sed 's/kubernetes.io\/metadata.name: vocabpipe-clients/kubernetes.io\/metadata.name: vocabpipe-cli/' \
  "$k8s/coordinator.yaml" > "$tmp/netpol.yaml"
if node "$validate" "$k8s/namespace.yaml" "$tmp/netpol.yaml" "$k8s/workers.yaml" > "$tmp/netpol.log"; then
  echo "FAIL: the validator accepted a NetworkPolicy for a namespace that does not exist"; exit 1
fi
grep -q 'namespaceSelector {"kubernetes.io/metadata.name":"vocabpipe-cli"} matches no namespace' \
  "$tmp/netpol.log" || { cat "$tmp/netpol.log"; exit 1; }
# A schema error: a Service port must be a number.
sed 's/port: 50051$/port: grpc-name/' "$k8s/coordinator.yaml" > "$tmp/schema.yaml"
if node "$validate" "$tmp/schema.yaml" > "$tmp/schema.log"; then
  echo "FAIL: the validator accepted a schema error"; exit 1
fi
grep -q "spec/ports/0/port must be integer" "$tmp/schema.log" || { cat "$tmp/schema.log"; exit 1; }
echo PASS
