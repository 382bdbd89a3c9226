#!/usr/bin/env bash
# Run `make test` N times in a row while a CPU hog keeps every core busy (issue 16: no test may
# depend on timing). The hog is one busy loop per core at normal priority, bounded by `timeout`
# and stopped when the runs end. Prints one line per run and exits non-zero if any run failed.
#
#   scripts/test-under-load.sh [N] [LOG_DIR]      (default 5 runs, logs in /tmp/test-under-load)
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
logs=${2:-/tmp/test-under-load}
mkdir -p "$logs"
cores=$(nproc)
hogs=()
for _ in $(seq "$cores"); do
    timeout 6h sh -c 'while :; do :; done' &
    hogs+=($!)
done
trap 'kill "${hogs[@]}" 2>/dev/null' EXIT
echo "$(date -u +%FT%TZ) $(git rev-parse --short HEAD): make test x$runs, $cores busy loops on $cores cores"
failed=0
for i in $(seq "$runs"); do
    start=$(date +%s)
    make test >"$logs/run-$i.log" 2>&1
    rc=$?
    summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)|^Tests: |[0-9]+ (passed|failed) \(' \
              "$logs/run-$i.log" | tr -s ' ' | paste -sd ';' -)
    echo "run $i: exit $rc in $(( $(date +%s) - start )) s; load $(cut -d' ' -f1 /proc/loadavg); $summary"
    [ "$rc" -eq 0 ] || failed=1
done
exit "$failed"
