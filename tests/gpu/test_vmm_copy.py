"""The VMM allocator's copy into an arena file and back (vmm_arena.c, copy_pieces), on the CPU
machine: the real library over a stand-in CUDA driver (fake_libcuda.c: "device" memory is
host memory, a released segment's bytes fault, a copy needs its device's context current in
the calling thread). Segments on two devices, larger than a piece (64 MiB), with live ranges;
a copy failing out or back; the threads' bounce buffers freed every time; the segments into
pinned host copies and back (ij_sleep, ij_wake); the cards' pieces taken in turn. The GPU
machine runs the same path for real (tests/kernel/test_gpu_arena.py, test_gpu_multi.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

CHILD = textwrap.dedent("""
    import ctypes, os, sys
    fake = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # found by its soname
    os.environ["INFINIJUP_VMM_LIB"] = sys.argv[2]
    from infinijup.gpu import vmm
    lib, arena = vmm._lib(), sys.argv[3]
    lib.ij_malloc.restype = ctypes.c_void_p
    lib.ij_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ij_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    MiB = 1 << 20

    def fill(ptr, size, seed):
        data = bytes((seed * 7 + i * 13) % 251 for i in range(251)) * (size // 251 + 1)
        ctypes.memmove(ptr, data, size)
        return data[:size]

    # three segments: two on device 0 (each over a piece), one on device 1
    sizes = [(100 * MiB, 0), (70 * MiB, 0), (40 * MiB, 1)]
    segs = [(lib.ij_malloc(n, dev, None), n) for n, dev in sizes]
    assert all(p for p, _ in segs), "ij_malloc failed"
    want = [fill(p, n, k) for k, (p, n) in enumerate(segs)]
    # live: all of segment 0; of segment 1 its first 10 MiB and its last 20 MiB; all of 2
    p1 = segs[1][0]
    live = sorted([(segs[0][0], 100 * MiB), (p1, 10 * MiB), (p1 + 50 * MiB, 20 * MiB),
                   (segs[2][0], 40 * MiB)])
    lib.ij_set_live(vmm._flat(live), len(live))

    def live_bytes():
        return [ctypes.string_at(a, n) for a, n in live]

    def fails_at(n, step):
        fake.fake_fail_copy_at(n)
        try:
            step(arena)
        except RuntimeError as exc:
            assert "CUDA error 999" in str(exc), exc
        else:
            raise SystemExit(f"{step} succeeded with copy {n} failing")
        assert fake.fake_host_live() == 0, "bounce buffers left after a failure"

    expect = live_bytes()
    offsets = {addr: off for addr, _size, off, _dev in vmm.layout()}

    # a copy failing on the way out: nothing released, every byte where it was
    fails_at(3, vmm.sleep_into)
    assert vmm.stats()["on_gpu"] == vmm.stats()["bytes"], vmm.stats()
    assert live_bytes() == expect, "a failed sleep_into changed the segments"

    moved = vmm.sleep_into(arena)
    assert moved == sum(n for _, n in live), (moved, live)
    assert vmm.stats()["on_gpu"] == 0
    assert fake.fake_host_live() == 0, "bounce buffers left"
    with open(arena, "rb") as f:
        for (addr, n), data in zip(live, expect):
            seg = max(a for a in offsets if a <= addr)
            f.seek(offsets[seg] + addr - seg)
            assert f.read(n) == data, "the file does not hold a live range"
        f.seek(offsets[p1] + 10 * MiB)  # dead: given back, reads as zeros
        assert f.read(40 * MiB) == bytes(40 * MiB), "dead bytes in the arena file"
    parts = vmm.timings()
    assert set(parts) == set(vmm.TIMING_KEYS) and parts["wait_s"] > 0, parts

    # the kernel's resume step (kernel_magics/gpu_vmm.bring_back), its wake failing: the
    # next try brings everything back, the server's word read once (here, the next
    # snapshot's: the next cell's is the same call)
    from infinijup.gpu import arena as arenas
    from infinijup.kernel_magics import gpu_vmm
    root, token = os.path.dirname(arena), "ab" * 16
    os.environ[gpu_vmm.ARENA_ROOT_ENV] = root
    gpu_vmm._state.update(installed=True, token=token, in_file=arena, go=None)
    with open(arenas.go_path(root, token), "w") as f:
        f.write("{}")  # the dump is over; the kernel takes its own arena file back
    fails_at(2, lambda _path: gpu_vmm.bring_back())
    assert vmm.stats()["in_file"] == sum(n for _, n in segs), vmm.stats()
    # a snapshot asked now tries once more first, and is refused when that fails too
    from infinijup.kernel_magics import unsavable
    fake.fake_fail_copy_at(1)
    reason, text = unsavable.why()
    assert reason == "gpu_not_back" and "CUDA error 999" in text, (reason, text)
    assert unsavable.why() is None  # this try brings everything back
    assert live_bytes() == expect, "the live bytes did not come back"
    assert vmm.stats()["in_file"] == 0 and gpu_vmm._state["token"] is None
    assert fake.fake_host_live() == 0

    # into the same file again, only what set_copy names: one changed MiB of segment 2
    ctypes.memset(segs[2][0] + 5 * MiB, 0x5A, MiB)
    expect = live_bytes()
    vmm.set_copy([(segs[2][0] + 5 * MiB, MiB)])
    assert vmm.sleep_into(arena) == MiB
    assert vmm.wake_from(arena) == moved
    assert live_bytes() == expect, "the second sleep lost a change or an unchanged range"

    # the other way (vmm_alloc.c): whole segments into pinned host copies, freed at the wake
    whole = [ctypes.string_at(p, n) for p, n in segs]
    assert vmm.sleep() == sum(n for _, n in segs) and vmm.stats()["on_gpu"] == 0
    assert fake.fake_host_live() == len(segs)
    assert vmm.wake() == sum(n for _, n in segs)
    assert [ctypes.string_at(p, n) for p, n in segs] == whole, "ij_wake lost bytes"
    assert fake.fake_host_live() == 0
    for p, n in segs:
        lib.ij_free(p, n, 0, None)
    assert vmm.stats()["segments"] == 0
    print("ok")
""")


def run_child(tmp_path: Path, child: str) -> None:
    """Build the stand-in driver and the allocator, run ``child`` over them in a process of
    its own, and check that it printed ok."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build the allocator and the stand-in driver")
    fake, lib = tmp_path / "libcuda.so.1", tmp_path / "libinfinijup_vmm.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(fake),
                    str(HERE / "fake_libcuda.c"), "-lpthread"], check=True)
    gpu = REPO / "infinijup" / "gpu"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(gpu / "vmm_alloc.c"),
                    str(gpu / "vmm_arena.c"), "-ldl", "-lpthread"], check=True)
    out = subprocess.run([sys.executable, "-c", child, str(fake), str(lib),
                          str(tmp_path / "arena")], cwd=REPO, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_segments_go_out_and_back_through_bounce_buffers(tmp_path: Path) -> None:
    run_child(tmp_path, CHILD)


IN_TURN = textwrap.dedent("""
    import ctypes, os, sys
    fake = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
    os.environ["INFINIJUP_VMM_LIB"] = sys.argv[2]
    os.environ["INFINIJUP_VMM_COPIERS"] = "1"  # one thread: the pieces go strictly in order
    from infinijup.gpu import vmm
    lib, arena = vmm._lib(), sys.argv[3]
    lib.ij_malloc.restype = ctypes.c_void_p
    lib.ij_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    fake.fake_copy_log.argtypes = [ctypes.POINTER(ctypes.c_int),
                                   ctypes.POINTER(ctypes.c_size_t), ctypes.c_long]
    MiB = 1 << 20

    # a model split over two cards: 192 MiB on card 0, then 128 MiB on card 1
    segs = [(lib.ij_malloc(n, dev, None), n) for n, dev in [(192 * MiB, 0), (128 * MiB, 1)]]
    assert all(p for p, _ in segs), "ij_malloc failed"
    for k, (p, n) in enumerate(segs):
        ctypes.memset(p, 0x11 * (k + 1), n)
    want = [ctypes.string_at(p, n) for p, n in segs]

    def runs():  # the copies as runs of one card: [card, MiB]
        device, size = (ctypes.c_int * 4096)(), (ctypes.c_size_t * 4096)()
        out = []
        for i in range(fake.fake_copy_log(device, size, 4096)):
            if out and out[-1][0] == device[i]:
                out[-1][1] += size[i] / MiB
            else:
                out.append([device[i], size[i] / MiB])
        return out

    runs()
    for way, step in (("out", vmm.sleep_into), ("back", vmm.wake_from)):
        assert step(arena) == sum(n for _, n in segs), way
        got = runs()
        # the cards take turns, a piece (64 MiB at most) each, until one has none left
        assert len(got) >= 4 and all(mib <= 64 for _, mib in got[:-1]), (way, got)
        assert {d: sum(m for c, m in got if c == d) for d in (0, 1)} == {0: 192, 1: 128}, got
    assert [ctypes.string_at(p, n) for p, n in segs] == want, "bytes lost on the way"
    print("ok")
""")


def test_the_cards_take_turns(tmp_path: Path) -> None:
    """A model split over two cards goes out and back with the cards' pieces in turn, so both
    cards' links carry copies at once (in segment order, all of one card went first)."""
    run_child(tmp_path, IN_TURN)
