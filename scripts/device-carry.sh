#!/usr/bin/env bash
# Prepare .carry/ (git-ignored) for a run on the GPU machine, which has no package registry:
# wheels of the project's Python dependencies for its python3.12, this machine's CRIU build with
# the shared libraries it links (run there through a wrapper, so only CRIU loads them), pycriu.
# Then on the device: `bash .carry/setup.sh` (installs into /tmp/site, writes /tmp/env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
CRIU_PREFIX=${CRIU_PREFIX:-/opt/infinijup/criu}
out=.carry
rm -rf "$out" && mkdir -p "$out/whl" "$out/criu/lib"
# The device's python3 has torch, numpy, protobuf 7 (pycriu needs < 7) and cuda-python. No
# boto3: the S3 remote is imported only by remote commands, and with it the carry passed the
# 64 MiB a run may carry. So on the device, run pytest with `-p no:s3server` (the tests' S3
# fixture plugin imports boto3).
.venv/bin/python -m pip download -q --dest "$out/whl" --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_5_x86_64 --platform any \
  "jupyter_server>=2.14,<3" "jupyter_client>=8.6" "ipykernel>=6.29" "blake3>=0.4" \
  "zstandard>=0.22" "protobuf>=6,<7" pytest "pytest-jupyter[server]>=0.10" pytest-timeout \
  psutil nvidia-ml-py "cryptography>=42" "argon2-cffi>=23.1"
# The project itself, for its entry points (the kernel provisioner); its code runs from the
# repo (PYTHONPATH), so edits need no new wheel.
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w "$out/whl" .
cp "$CRIU_PREFIX/sbin/criu" "$out/criu/criu.bin"
ldd "$CRIU_PREFIX/sbin/criu" | awk '/=> \// {print $3}' | grep -vE '/libc\.so|/ld-linux' \
  | xargs -I{} cp -L {} "$out/criu/lib/"
cp -r "$CRIU_PREFIX/python" "$out/criu/python"
cat > "$out/criu/criu" <<'WRAP'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/lib" exec "$here/criu.bin" "$@"
WRAP
chmod +x "$out/criu/criu"
cat > "$out/setup.sh" <<'SETUP'
#!/usr/bin/env bash
# On the GPU machine, from the repo root: install the carried wheels beside the system's torch.
set -e
here=$(cd "$(dirname "$0")" && pwd)
python3 -m pip install -q --no-index --find-links "$here/whl" --target /tmp/site \
  --no-compile jupyter_server jupyter_client ipykernel blake3 zstandard "protobuf<7" pytest \
  pytest-jupyter pytest-timeout psutil nvidia-ml-py cryptography argon2-cffi 2>&1 | grep -v "^WARNING\|^ERROR: pip's" || true
python3 -m pip install -q --no-index --no-deps --find-links "$here/whl" --target /tmp/site \
  --no-compile infinijup 2>&1 | grep -v "^WARNING" || true
repo=$(cd "$here/.." && pwd)
cat > /tmp/env.sh <<ENV
export PYTHONPATH=$repo:/tmp/site
export PATH=/tmp/site/bin:\$PATH
export INFINIJUP_CRIU=$here/criu/criu
export INFINIJUP_PYCRIU=$here/criu/python
export PYTHONUNBUFFERED=1
ENV
SETUP
du -sh "$out"
