#!/usr/bin/env bash
# Installs a kvr Debian package into a fresh Debian 12 root, as a user's `apt-get install ./kvr_*.deb`
# would, and runs the installed kvr there. Needs root and a Debian mirror, so it is not part of the
# test suite (which checks the package's Depends against the libraries kvr loads instead).
# Usage: sudo deploy/scripts/check_deb_fresh_root.sh path/to/kvr_<version>_amd64.deb [MIRROR]
set -euo pipefail

deb=$(realpath "${1:?usage: $0 path/to/kvr_<version>_amd64.deb [mirror]}")
mirror=${2:-http://deb.debian.org/debian}
command -v debootstrap >/dev/null || apt-get install -y -q debootstrap
root=$(mktemp -d "${TMPDIR:-/tmp}/kvr-fresh-root.XXXXXX")
chmod 755 "$root"  # apt downloads as the _apt user
cleanup() {
  umount "$root/proc" 2>/dev/null || true
  rm -rf "$root"
}
trap cleanup EXIT

echo "debootstrap bookworm (minbase) into $root"
debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.log" 2>&1 ||
  { tail -20 "$root.log" >&2; exit 1; }
rm -f "$root.log"
cp "$deb" "$root/tmp/"
cp /etc/resolv.conf "$root/etc/resolv.conf"
mount -t proc proc "$root/proc"
chroot "$root" bash -euo pipefail -c "
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends /tmp/$(basename "$deb") | tail -3
  kvr --version
  kvr node --help >/dev/null
  test -f /usr/lib/cmake/kvr/kvrConfig.cmake
  test -f /usr/lib/systemd/system/kvr-node.service
  echo 'kvr installed and ran in a fresh Debian 12 root'
"
