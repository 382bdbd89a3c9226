"""PyTorch's CUDA memory on Infinijup's VMM allocator (vmm_alloc.c), first step of issue 13.

``install()`` puts every CUDA allocation of the calling thread into a MemPool whose segments
come from ``vmm_alloc.c`` (CUDA virtual memory: reserved addresses, physical memory mapped
under them). ``sleep()`` copies the segments to pinned host memory and frees the GPU memory
without moving a single address; ``wake()`` maps new physical memory at the same addresses and
copies the contents back. Must be installed before PyTorch's first CUDA allocation.

Kernels use it through ``kernel_magics/gpu_vmm.py``: the snapshot's segments go into an arena
file (:func:`sleep_into`), and a second snapshot copies only the ranges whose GPU-side hashes
changed (``block_hash.py``, :func:`set_copy`).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

LIB_ENV = "INFINIJUP_VMM_LIB"
_state: dict = {}


def library_path() -> str:
    return os.environ.get(LIB_ENV) or str(Path(__file__).with_name("libinfinijup_vmm.so"))


def _lib() -> ctypes.CDLL:
    if "lib" not in _state:
        lib = ctypes.CDLL(library_path())
        lib.ij_sleep.restype = ctypes.c_longlong
        lib.ij_wake.restype = ctypes.c_longlong
        lib.ij_sleep_into.restype = ctypes.c_longlong
        lib.ij_sleep_into.argtypes = [ctypes.c_int]
        lib.ij_wake_from.restype = ctypes.c_longlong
        lib.ij_wake_from.argtypes = [ctypes.c_int]
        lib.ij_set_live.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.ij_set_copy.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.ij_layout.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.ij_timings.argtypes = [ctypes.c_void_p]
        _state["lib"] = lib
    return _state["lib"]


def install(device: int | None = None) -> None:
    """Route this thread's CUDA allocations to the VMM allocator: on ``device``, or on every
    device PyTorch sees (None). A MemPool belongs to one device, so each device gets its own,
    all on the same allocator (the segments know their device)."""
    import torch

    if "pools" in _state:
        return
    allocator = torch.cuda.memory.CUDAPluggableAllocator(library_path(), "ij_malloc", "ij_free")
    devices = [device] if device is not None else list(range(torch.cuda.device_count()))
    pools, contexts = [], []
    for dev in devices:
        pool = _pool_on(torch, dev, allocator)
        context = torch.cuda.use_mem_pool(pool, device=dev)
        context.__enter__()
        pools.append(pool)
        contexts.append(context)
    _state.update(pools=pools, contexts=contexts, allocator=allocator, devices=devices)


def _pool_on(torch, device: int, allocator):  # noqa: ANN001, ANN202
    """A MemPool of ``device`` (it takes the current device), made without creating a CUDA
    context there: a kernel that never touches a card must not pay a context on it."""
    exchange = getattr(torch.cuda, "_maybe_exchange_device", None)
    if exchange is None:
        with torch.cuda.device(device):
            return torch.cuda.MemPool(allocator.allocator())
    before = exchange(device)  # without a context there, only PyTorch's "target" device
    try:
        return torch.cuda.MemPool(allocator.allocator())
    finally:
        # back, and the target forgotten: exchanging back to the device CUDA already has
        # current returns early and would leave the target set (every later allocation on
        # the wrong card); set_device clears it, and does nothing else when already there
        exchange(before)
        torch.cuda.set_device(before)


ON_SHORT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_size_t, ctypes.c_int)


def set_on_short(fn) -> None:  # noqa: ANN001 - fn(bytes, device) -> bool
    """Call ``fn(bytes, device)`` when a segment finds no room on the GPU; if it answers true
    the allocator tries once more (then PyTorch's own out-of-memory handling goes on)."""

    def call(nbytes: int, device: int) -> int:
        try:
            return 1 if fn(int(nbytes), int(device)) else 0
        except Exception:  # nothing may escape into the allocator
            return 0

    callback = ON_SHORT(call)
    _state["on_short"] = callback  # kept alive as long as the allocator may call it
    lib = _lib()
    lib.ij_set_on_short.argtypes = [ON_SHORT]
    lib.ij_set_on_short(callback)


def sleep() -> int:
    """Bytes moved to host memory; the GPU memory under them is free."""
    moved = _lib().ij_sleep()
    if moved < 0:
        raise RuntimeError(f"VMM sleep failed (CUDA error {_lib().ij_last_error()})")
    return int(moved)


def wake() -> int:
    moved = _lib().ij_wake()
    if moved < 0:
        raise RuntimeError(f"VMM wake failed (CUDA error {_lib().ij_last_error()})")
    return int(moved)


def keep_host(keep: bool) -> None:
    """Keep the pinned host copies between snapshots (twice the memory, sleeps at copy speed)."""
    _lib().ij_keep_host(int(keep))


def stats() -> dict[str, int]:
    """Segments and their bytes; ``on_gpu``: mapped on the GPU; ``in_file``: whose contents
    are in an arena file, not back yet (asleep, or mapped by a wake that failed)."""
    out = [ctypes.c_longlong() for _ in range(4)]
    _lib().ij_stats(*(ctypes.byref(v) for v in out))
    return dict(zip(("segments", "bytes", "on_gpu", "in_file"), (v.value for v in out),
                    strict=True))


MERGE_GAP = 1 << 20  # live ranges closer than this are copied as one (as vmm_arena.c merges)


def mark_live() -> list[tuple[int, int]]:
    """Tell the allocator which bytes of its segments PyTorch has in use (blocks not
    "inactive" in its memory snapshot): the next :func:`sleep_into` copies only those, the
    cached free rest is not a snapshot's to hold. Returns the live ranges as (address, length)
    pairs, sorted, merged across gaps under 1 MiB: exactly what a full copy moves."""
    import torch

    pairs = []
    for seg in torch.cuda.memory_snapshot():
        at = int(seg["address"])
        for block in seg["blocks"]:
            size = int(block["size"])
            start = int(block.get("address", at))
            if block.get("state") != "inactive" and size:
                pairs.append((start, size))
            at = start + size
    pairs.sort()
    merged: list[list[int]] = []
    for start, size in pairs:
        if merged and start <= merged[-1][0] + merged[-1][1] + MERGE_GAP:
            merged[-1][1] = max(merged[-1][1], start + size - merged[-1][0])
        else:
            merged.append([start, size])
    _lib().ij_set_live(_flat(merged), len(merged))
    return [(a, n) for a, n in merged]


def _flat(pairs) -> ctypes.Array:  # noqa: ANN001
    return (ctypes.c_ulonglong * (2 * len(pairs) or 1))(*(v for pair in pairs for v in pair))


def layout() -> list[tuple[int, int, int, int]]:
    """The segments on the GPUs as (address, size, offset in the arena file, device); a segment
    keeps its offset from one :func:`sleep_into` to the next."""
    lib = _lib()
    count = lib.ij_layout(None, 0)
    out = (ctypes.c_ulonglong * (4 * count or 1))()
    count = min(count, lib.ij_layout(out, count))
    return [(out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]) for i in range(count)]


def set_copy(pairs: list[tuple[int, int]] | None) -> None:
    """Have the next :func:`sleep_into` copy only these (address, length) ranges, sorted: the
    live ranges that changed since the last one into the same file. None: every live range."""
    if pairs is None:
        _lib().ij_set_copy(None, -1)
    elif _lib().ij_set_copy(_flat(pairs), len(pairs)) != 0:
        raise MemoryError("the allocator could not take the list of ranges to copy")


def sleep_into(path: str | os.PathLike) -> int:
    """Move every segment on the GPU into the file at ``path`` (created, or reused: a file whose
    pages are already there takes them at copy-engine speed), each at its offset, only its live
    ranges where :func:`mark_live` gave them; the GPU memory under them is free. Returns the
    bytes copied (0: nothing was on the GPU)."""
    lib = _lib()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        moved = lib.ij_sleep_into(fd)
    finally:
        os.close(fd)
    if moved < 0:
        err = lib.ij_last_errno()
        if err:  # the file's pages could not be reserved: nothing was copied or released
            raise OSError(err, f"the GPU arena cannot hold the segments: {os.strerror(err)}",
                          str(path))
        raise RuntimeError(f"VMM sleep into {path} failed (CUDA error {lib.ij_last_error()})")
    return int(moved)


def wake_from(path: str | os.PathLike) -> int:
    """Map the segments moved by :func:`sleep_into` again at their addresses and fill them from
    ``path`` (that file, or the copy a restore brought back)."""
    lib = _lib()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        moved = lib.ij_wake_from(fd)
    finally:
        os.close(fd)
    if moved == -2:
        raise RuntimeError(f"VMM wake: {path} is shorter than the segments it should hold")
    if moved < 0:
        raise RuntimeError(f"VMM wake from {path} failed (CUDA error {lib.ij_last_error()})")
    return int(moved)


TIMING_KEYS = ("wait_s", "prepare_s", "copy_s", "free_s", "stage_s")


def timings() -> dict[str, float]:
    """Seconds the last :func:`sleep_into` or :func:`wake_from` spent, part by part (see
    copy_pieces in vmm_arena.c): waiting for the copying threads; then, summed over them,
    making the file's pages present and allocating their pinned bounce buffers, copying to or
    from the GPU, freeing the buffers, copying between the buffers and the file's pages."""
    out = (ctypes.c_double * 5)()
    _lib().ij_timings(out)
    return {k: round(v, 3) for k, v in zip(TIMING_KEYS, out, strict=True)}
