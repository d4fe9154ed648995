#!/usr/bin/env bash
# Builds Kyverno's admission controller (github.com/kyverno/kyverno cmd/kyverno) from its Go module into an
# ignored cache folder, with its CRDs beside it, for scenario (d) of `bench/run admission --with-kyverno`.
# Does nothing when that version is built. About 35 minutes of `nice -n 19` on the 2-core development VM;
# 262 MB. Prints the folder on its last line.
#   bash bench/kyverno/build.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
version=v1.19.1
out=${GPUGUARD_KYVERNO:-$root/.cache/kyverno/$version}
if [ -x "$out/kyverno" ] && [ -d "$out/crds" ]; then
  echo "$out"
  exit 0
fi
command -v go >/dev/null || { echo "kyverno/build.sh: Go is needed (apt-get install golang)" >&2; exit 1; }
# The module's go.mod has replace directives, which `go install module@version` refuses: build inside a
# writable copy of the module instead.
src=$(go mod download -json "github.com/kyverno/kyverno@$version" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
[ -d "$src" ] || { echo "kyverno/build.sh: go mod download gave no module folder" >&2; exit 1; }
rm -rf "$out.partial" && mkdir -p "$out.partial"
cp -r "$src" "$out.partial/src" && chmod -R u+w "$out.partial/src"
start=$SECONDS
echo "kyverno/build.sh: building Kyverno $version into $out (about 35 minutes on 2 cores)" >&2
(cd "$out.partial/src" && GOTOOLCHAIN=local nice -n 19 go build -trimpath -ldflags "-s -w" \
  -o "$out.partial/kyverno" ./cmd/kyverno)
cp -r "$out.partial/src/config/crds" "$out.partial/crds"
rm -rf "$out.partial/src" "$out" && mv "$out.partial" "$out"
echo "kyverno/build.sh: built in $((SECONDS - start)) s" >&2
echo "$out"
