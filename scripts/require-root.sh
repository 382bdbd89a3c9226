#!/usr/bin/env bash
# Usage: require-root.sh "what needs root" "command to run"
# Exits 2 with a clear message when not root; a no-op as root.
if [ "$(id -u)" -ne 0 ]; then
  echo "infinijup: $1 needs root." >&2
  echo "  run: $2" >&2
  exit 2
fi
