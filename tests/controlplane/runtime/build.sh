#!/usr/bin/env bash
# Provides what a real node needs beside the kubelet (tests/node), in an ignored cache folder, and
# does nothing when it is already there. Prints the folder on its last line.
#   containerd, containerd-shim-runc-v2, ctr: built from the Go modules pinned in go.mod (CGO off)
#   pause: the pod sandbox's process, a static C program (pause.c)
# and, with apt-get when they are missing (Debian packages, root only): runc (the OCI runtime
# containerd starts containers with), containernetworking-plugins (the CNI loopback plugin the
# pods' network uses), busybox-static (the shell and tools of the test image), gcc and libc6-dev.
#   bash tests/controlplane/runtime/build.sh
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../../.." && pwd)
cd "$here"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod

missing=()
for package in runc containernetworking-plugins busybox-static gcc libc6-dev; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed' || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "runtime/build.sh: installing ${missing[*]} with apt-get" >&2
  export DEBIAN_FRONTEND=noninteractive
  # A fresh machine's package lists may be empty or stale: update once, then install.
  nice apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 ||
    { nice apt-get update -qq >&2 && nice apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2; }
fi

version=$(awk '$1 == "github.com/containerd/containerd/v2" {print $2}' go.mod)
[ -n "$version" ] || { echo "runtime/build.sh: go.mod does not require containerd v2" >&2; exit 1; }
out=${GPUGUARD_NODE_RUNTIME_BIN:-$root/.cache/node-runtime/containerd-$version}
commands=(containerd containerd-shim-runc-v2 ctr)
built=1
for binary in "${commands[@]}"; do
  [ -x "$out/$binary" ] || built=0
done
if [ "$built" = 0 ]; then
  command -v go >/dev/null || { echo "runtime/build.sh: Go is needed to build containerd" >&2; exit 1; }
  echo "runtime/build.sh: building containerd $version into $out (about 2 minutes on 2 cores; 12 with empty Go caches)" >&2
  start=$SECONDS
  mkdir -p "$out.partial"
  # The tags leave out the snapshotters the tests do not use (overlayfs is the one they do).
  nice go build -trimpath -tags "no_btrfs no_devmapper no_zfs" \
    -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=${version#v}" \
    -o "$out.partial/" "${commands[@]/#/github.com/containerd/containerd/v2/cmd/}"
  rm -rf "$out" && mv "$out.partial" "$out"
  echo "runtime/build.sh: built in $((SECONDS - start)) s" >&2
fi
if [ ! -x "$out/pause" ] || [ pause.c -nt "$out/pause" ]; then
  gcc -static -O2 -Wall -Werror -o "$out/pause.partial" pause.c
  mv "$out/pause.partial" "$out/pause"
fi
echo "$out"
