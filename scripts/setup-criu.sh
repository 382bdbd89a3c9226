#!/usr/bin/env bash
# Provide CRIU >= 4.2 for Infinijup.
#
# An installed `criu` of 4.2 or newer is used as it is. Otherwise CRIU is built from
# Debian's source package (sid carries 4.2.x; Debian 12's 3.17 fails on kernels >= 6.x vDSO,
# 4.1 cannot dump TCP sockets on kernels >= 6.16) and installed under $PREFIX, which the
# project owns. pycriu is installed into $PREFIX/python so a virtualenv can import it.
#
# Usage: setup-criu.sh [PREFIX]     (default /opt/infinijup/criu)
set -euo pipefail

PREFIX=${1:-${INFINIJUP_CRIU_PREFIX:-/opt/infinijup/criu}}
WANT_MAJOR=4 WANT_MINOR=2
BUILD_DEPS=(build-essential pkgconf libbsd-dev libcap-dev libgnutls28-dev libnet1-dev
  libnftables-dev libnl-3-dev libprotobuf-c-dev libprotobuf-dev protobuf-c-compiler
  protobuf-compiler uuid-dev python3-protobuf xz-utils iproute2)

log() { echo "[setup-criu] $*"; }

version_ok() {  # $1: path of a criu binary
  local v
  v=$("$1" --version 2>/dev/null | sed -n 's/^Version: *//p') || return 1
  [ -n "$v" ] || return 1
  local major=${v%%.*} rest=${v#*.}
  local minor=${rest%%.*}
  [ "$major" -gt $WANT_MAJOR ] || { [ "$major" -eq $WANT_MAJOR ] && [ "$minor" -ge $WANT_MINOR ]; }
}

if [ -x "$PREFIX/sbin/criu" ] && version_ok "$PREFIX/sbin/criu" && [ -d "$PREFIX/python/pycriu" ]; then
  log "CRIU $("$PREFIX/sbin/criu" --version | sed -n 's/^Version: *//p') already in $PREFIX"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "setup-criu: building and installing CRIU needs root (apt-get build deps, install to $PREFIX)." >&2
  echo "  run: sudo make criu    (or: sudo $0 $PREFIX)" >&2
  exit 2
fi

export DEBIAN_FRONTEND=noninteractive
missing=()
for p in "${BUILD_DEPS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing build dependencies: ${missing[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

work=$(mktemp -d /tmp/infinijup-criu.XXXXXX)
trap 'rm -rf "$work"' EXIT
cd "$work"

# Fetch the orig tarball from Debian sid's source package, with a private apt state so the
# system's sources are left alone.
log "fetching CRIU source from Debian sid"
mkdir -p apt/lists/partial apt/etc
echo "deb-src http://deb.debian.org/debian sid main" > apt/etc/sources.list
aptopt=(-o Dir::Etc::SourceList="$work/apt/etc/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o Dir::State::Lists="$work/apt/lists" -o APT::Sandbox::User=root -qq)
tarball=""
if apt-get "${aptopt[@]}" update && (apt-get "${aptopt[@]}" source --download-only criu || true); then
  tarball=$(ls criu_*.orig.tar.* 2>/dev/null | head -1 || true)
fi
if [ -z "$tarball" ]; then
  # The .debian.tar.xz has 404'd before while the orig tarball was there: fetch it from the pool.
  v=$(grep -h -A3 '^Package: criu$' apt/lists/*Sources 2>/dev/null | sed -n 's/^Version: *//p' | head -1)
  v=${v%-*}; v=${v#*:}
  [ -n "$v" ] || { echo "setup-criu: could not find criu in Debian sid's sources" >&2; exit 1; }
  apt-get install -y -qq --no-install-recommends curl ca-certificates >/dev/null
  curl -fsSLO "http://deb.debian.org/debian/pool/main/c/criu/criu_${v}.orig.tar.xz"
  tarball=criu_${v}.orig.tar.xz
fi
log "building from $tarball"
tar xf "$tarball"
src=$(find . -maxdepth 1 -type d -name 'criu-*' | head -1)
cd "$src"
make -j"$(nproc)" criu >build.log 2>&1 || { tail -40 build.log; exit 1; }
make -j"$(nproc)" lib >>build.log 2>&1 || { tail -40 build.log; exit 1; }

rm -rf "$PREFIX.new"
mkdir -p "$PREFIX.new/sbin" "$PREFIX.new/python"
install -m 0755 criu/criu "$PREFIX.new/sbin/criu"
cp -r lib/pycriu "$PREFIX.new/python/pycriu"
find "$PREFIX.new/python" -name '__pycache__' -prune -exec rm -rf {} +
rm -rf "$PREFIX"
mv "$PREFIX.new" "$PREFIX"
log "installed $("$PREFIX/sbin/criu" --version | sed -n 's/^Version: *//p') to $PREFIX"
"$PREFIX/sbin/criu" check 2>&1 | tail -1 || true
