#!/usr/bin/env bash
# Installs the bench's load generators when missing, from Debian's packages: wrk (the latency figures,
# also used by the fleet bench's smoke test in the suite), hey (the saturation runs) and taskset
# (util-linux; the benches pin server and load to separate cores). As root, or through sudo.
#   bash bench/tools.sh
set -euo pipefail
missing=()
command -v wrk >/dev/null || missing+=(wrk)
command -v hey >/dev/null || missing+=(hey)
command -v taskset >/dev/null || missing+=(util-linux)
[ ${#missing[@]} -gt 0 ] || exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo=sudo
echo "bench/tools.sh: installing ${missing[*]} with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
# A fresh machine has no package lists yet: update once, only when the install needs it.
$sudo apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 \
  || { $sudo apt-get update -qq && $sudo apt-get install -y -qq "${missing[@]}" >/dev/null; }
