#!/bin/sh
# A GPU node's preflight for Infinijup: run by deploy/kubernetes/node-check.yaml in the
# single-user image, with the privileges of the single-user pods. Prints what it found and
# exits 0 when the node can run Infinijup's GPU snapshots, 1 (saying why) when it cannot:
#   - Linux >= 5.9 (CAP_CHECKPOINT_RESTORE, which the helper's CRIU runs need);
#   - an NVIDIA kernel driver >= 570 (the CUDA driver's process checkpoint API);
#   - `criu check` passes in this container;
#   - the helper starts here and answers.
set -u
MIN_KERNEL_MAJOR=5 MIN_KERNEL_MINOR=9 MIN_DRIVER=570
driver_file=${NVIDIA_VERSION_FILE:-/host/proc/driver/nvidia/version}
criu=${INFINIJUP_CRIU:-/opt/infinijup/criu/sbin/criu}
helper=${INFINIJUP_HELPER_BIN:-/opt/infinijup/helper/bin/infinijup-helper}
failed=0
fail() { echo "FAIL: $*"; failed=1; }

kernel=$(uname -r)
major=${kernel%%.*} rest=${kernel#*.}
minor=${rest%%[!0-9]*}
echo "kernel: $kernel"
if [ "$major" -lt $MIN_KERNEL_MAJOR ] || { [ "$major" -eq $MIN_KERNEL_MAJOR ] && [ "$minor" -lt $MIN_KERNEL_MINOR ]; }; then
  fail "Linux $MIN_KERNEL_MAJOR.$MIN_KERNEL_MINOR or newer is needed (CAP_CHECKPOINT_RESTORE)"
fi

if [ -r "$driver_file" ]; then
  driver=$(awk '/NVRM version/ { for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]+\.[0-9]+(\.[0-9]+)?$/) { print $i; exit } }' "$driver_file")
  echo "NVIDIA driver: ${driver:-unreadable}"
  if [ -z "$driver" ] || [ "${driver%%.*}" -lt $MIN_DRIVER ]; then
    fail "an NVIDIA driver >= $MIN_DRIVER is needed (the CUDA driver's checkpoint API)"
  fi
else
  fail "no NVIDIA driver on this node ($driver_file is missing)"
fi

echo "CRIU: $("$criu" --version 2>&1 | sed -n 's/^Version: *//p')"
if ! "$criu" check; then
  fail "criu check failed here (the container's capabilities, seccomp or AppArmor profile?)"
fi

dir=$(mktemp -d /tmp/infinijup-node-check.XXXXXX)
chmod 0755 "$dir"
head -c 32 /dev/urandom > "$dir/seal-key.tmp"
mkdir -m 0711 "$dir/work" && install -m 0600 "$dir/seal-key.tmp" "$dir/work/.seal-key"
if env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$helper" --daemon \
     --socket "$dir/helper.sock" --work "$dir/work" --pidfile "$dir/helper.pid" \
     --log "$dir/helper.log"; then
  INFINIJUP_HELPER_SOCKET="$dir/helper.sock" infinijup helper || fail "the helper did not answer"
  kill "$(cat "$dir/helper.pid")"
else
  cat "$dir/helper.log"
  fail "the helper did not start"
fi
rm -rf "$dir" 2>/dev/null || true

if [ "$failed" -eq 0 ]; then
  echo "OK: this node can run Infinijup"
fi
exit "$failed"
