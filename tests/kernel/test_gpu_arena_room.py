"""An arena too small for the segments (issue 27, "host memory running out mid-release"): the
arena file is written through a shared mapping, and a page the tmpfs cannot give during the
copy is a SIGBUS in the kernel. The allocator reserves the file's pages before it copies
anything, so a full arena is an ENOSPC before a byte moves, every tensor stays on the GPU, and
the snapshot or release takes the driver's path. On the GPU machine, as root (it mounts two
small tmpfs); in a child process, so that a SIGBUS would show as its exit status."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

HAS_GPU = os.path.exists("/dev/nvidiactl") and shutil.which("nvidia-smi") is not None

pytestmark = [pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU (the device machine)"),
              pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root"),
              pytest.mark.timeout(300)]

CHILD = textwrap.dedent("""
    import sys, torch
    from infinijup.gpu import vmm
    vmm.install(0)
    x = torch.arange(16 << 20, device="cuda", dtype=torch.int32)  # 64 MiB
    total = int(x.sum())
    vmm.mark_live()
    try:
        vmm.sleep_into(sys.argv[1] + "/segments")
        print("small arena: moved")
    except OSError as err:
        print("small arena: refused", err.errno)
    print("on the GPU:", vmm.stats()["on_gpu"] >= 64 << 20, int(x.sum()) == total)
    vmm.mark_live()
    moved = vmm.sleep_into(sys.argv[2] + "/segments")
    print("large arena: moved", moved >= 64 << 20, "on the GPU:", vmm.stats()["on_gpu"])
    vmm.wake_from(sys.argv[2] + "/segments")
    print("back:", int(x.sum()) == total)
""")


def test_a_full_arena_refuses_before_a_byte_moves(tmp_path):
    small, large = tmp_path / "small", tmp_path / "large"
    mounted = []
    try:
        for path, size in ((small, "16m"), (large, "256m")):
            path.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                            str(path)], check=True)
            mounted.append(path)
        out = subprocess.run([sys.executable, "-c", CHILD, str(small), str(large)],
                             capture_output=True, text=True, timeout=240)
    finally:
        for path in mounted:
            subprocess.run(["umount", str(path)], check=False)
    assert out.returncode == 0, f"exit {out.returncode} (-7 is SIGBUS)\n{out.stdout}{out.stderr}"
    lines = out.stdout.splitlines()
    assert lines == ["small arena: refused 28", "on the GPU: True True",
                     "large arena: moved True on the GPU: 0", "back: True"], out.stdout
