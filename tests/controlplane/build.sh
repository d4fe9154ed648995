#!/usr/bin/env bash
# Builds the control plane and node binaries (kube-apiserver, kube-controller-manager, kube-scheduler,
# kubelet, kubectl, etcd) from the Go modules pinned in go.mod into an ignored cache folder, and does
# nothing when that version is already built. Prints the folder on its last line.
#   bash tests/controlplane/build.sh
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$here"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod

version=$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" {print $3} $1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2}' go.mod)
[ -n "$version" ] || { echo "build.sh: go.mod does not require k8s.io/kubernetes" >&2; exit 1; }
out=${GPUGUARD_K8S_BIN:-$root/.cache/k8s-bin/$version}
kube_commands=(kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl)
built=1
for binary in "${kube_commands[@]}" etcd; do
  [ -x "$out/$binary" ] || built=0
done
if [ "$built" = 1 ]; then
  echo "$out"
  exit 0
fi
command -v go >/dev/null || { echo "build.sh: Go is needed to build the control plane (apt-get install golang)" >&2; exit 1; }

minor=${version#v1.}; minor=${minor%%.*}
# The same keys upstream's hack/lib/version.sh stamps, so the apiserver reports and emulates $version.
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags="$ldflags -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
done
mkdir -p "$out.partial"
start=$SECONDS
echo "build.sh: building Kubernetes $version control plane into $out (cold build: about 10 minutes on 2 cores)" >&2
for binary in "${kube_commands[@]}"; do
  go build -trimpath -ldflags "$ldflags" -o "$out.partial/$binary" "k8s.io/kubernetes/cmd/$binary"
done
go build -trimpath -ldflags "-s -w" -o "$out.partial/etcd" go.etcd.io/etcd/server/v3
rm -rf "$out" && mv "$out.partial" "$out"
echo "build.sh: built in $((SECONDS - start)) s" >&2
echo "$out"
