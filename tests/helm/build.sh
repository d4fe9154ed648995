#!/usr/bin/env bash
# Builds Helm from the Go module proxy (helm.sh/helm/v4 at the version below, with Helm's own go.sum,
# which `go install pkg@version` verifies against the checksum database) into an ignored cache folder, and
# does nothing when that version is already built. Prints the binary's path on its last line.
#   bash tests/helm/build.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
version=v4.3.2
out=${GPUGUARD_HELM_BIN:-$root/.cache/helm/$version}
if [ -x "$out/helm" ]; then
  echo "$out/helm"
  exit 0
fi
command -v go >/dev/null || { echo "tests/helm/build.sh: Go is needed to build Helm (apt-get install golang)" >&2; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0
start=$SECONDS
echo "tests/helm/build.sh: building Helm $version into $out (cold build: a few minutes on 2 cores)" >&2
mkdir -p "$out.partial"
# The version keys Helm's Makefile stamps, so `helm version` says what was built.
GOBIN="$out.partial" go install -trimpath \
  -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$version -X helm.sh/helm/v4/internal/version.gitTreeState=clean" \
  "helm.sh/helm/v4/cmd/helm@$version"
rm -rf "$out" && mv "$out.partial" "$out"
echo "tests/helm/build.sh: built in $((SECONDS - start)) s" >&2
echo "$out/helm"
