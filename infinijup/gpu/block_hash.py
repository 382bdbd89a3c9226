"""Which live GPU bytes changed since the last snapshot, found on the GPU (issue 13).

A snapshot's live ranges are cut into blocks of 2 MiB; each block gets a 128-bit hash computed
where it lies, in GPU memory: two sums of its 64-bit words times fixed random odd multipliers,
modulo 2**64 (integer arithmetic: the same bits give the same sums, whatever order the GPU adds
them in). A block whose address, length, place in the arena file and hash are those of the last
snapshot into the same file is already there, byte for byte (with the odds of a 128-bit hash
collision); only the other blocks are copied. Reading 10 GB on an H100 for this costs tens of
milliseconds; copying it costs about a second.

On several GPUs (issue 33) each block is hashed on its own card, with that card's copy of the
multipliers.

The hashes are only as good as the file: the caller forgets them when the file is not the one
they describe (another inode, a restore brought other contents back).
"""

from __future__ import annotations

BLOCK = 2 << 20  # bytes per hashed block
_WORDS = BLOCK // 8
_BATCH = 32  # blocks per kernel launch (the products take _BATCH * BLOCK bytes at a time)
_state: dict = {}

Key = tuple[int, int, int]  # (address, length, offset in the arena file)


class _Span:
    """A raw range of GPU memory as int64 words, for ``torch.as_tensor``."""

    def __init__(self, address: int, words: int) -> None:
        self.__cuda_array_interface__ = {"shape": (words,), "typestr": "<i8",
                                         "data": (address, False), "version": 3, "strides": None}


def prepare(devices: list[int] | None = None) -> None:
    """Allocate the multipliers (4 MiB on each GPU in ``devices``, default the current one,
    kept): before the live ranges are taken."""
    import torch

    for device in devices if devices is not None else [torch.cuda.current_device()]:
        _multipliers(torch, device)


def _multipliers(torch, device: int):  # noqa: ANN001, ANN202
    if device not in _state:
        g = torch.Generator(device="cpu").manual_seed(0x1F1A1A)
        m = torch.randint(-(2**62), 2**62, (2, _WORDS), dtype=torch.int64, generator=g) * 2 + 1
        _state[device] = m.to(f"cuda:{device}")
    return _state[device]


Item = tuple[Key, int, int, int]  # (key, address, length, device)


def blocks(ranges: list[tuple[int, int]],
           layout: list[tuple[int, int, int, int]]) -> list[Item]:
    """The blocks of ``ranges`` (address, length), each as (key, address, length, device), cut
    at the segments' bounds, with its offset in the arena file from ``layout`` (address, size,
    offset, device) of the segments on the GPUs. Bytes outside them get no block."""
    segs = sorted(layout)
    out = []
    for address, length in ranges:
        end = address + length
        for base, size, offset, device in segs:
            lo, hi = max(address, base), min(end, base + size)
            at = lo
            while at < hi:
                n = min(BLOCK, hi - at)
                out.append(((at, n, offset + at - base), at, n, device))
                at += n
    return out


def devices_of(layout: list[tuple[int, int, int, int]]) -> list[int]:
    return sorted({device for *_, device in layout})


def hashes(items: list[Item]) -> dict[Key, tuple[int, int]]:
    """Each block's 128-bit hash, computed on the GPU where it lies (blocks whose length is not
    a multiple of 8 bytes get none: they are always copied)."""
    out: dict[Key, tuple[int, int]] = {}
    for device in sorted({item[3] for item in items}):
        _hash_on(device, [item for item in items if item[3] == device], out)
    return out


def _hash_on(device: int, items: list[Item], out: dict[Key, tuple[int, int]]) -> None:
    import torch

    m = _multipliers(torch, device)
    where = f"cuda:{device}"
    run: list[tuple[Key, int]] = []  # consecutive full blocks, contiguous in memory

    def flush() -> None:
        if not run:
            return
        words = torch.as_tensor(_Span(run[0][1], len(run) * _WORDS), device=where)
        rows = words.view(len(run), _WORDS)
        sums = [torch.stack([(part * m[0]).sum(1), (part * m[1]).sum(1)], 1)
                for part in rows.split(_BATCH)]
        for (key, _), pair in zip(run, torch.cat(sums).tolist(), strict=True):
            out[key] = (pair[0], pair[1])
        run.clear()

    for key, address, n, _ in items:
        if n == BLOCK:
            if run and run[-1][1] + BLOCK != address:
                flush()
            run.append((key, address))
            continue
        flush()
        if n % 8 == 0:
            words = torch.as_tensor(_Span(address, n // 8), device=where)
            out[key] = ((words * m[0, :n // 8]).sum().item(), (words * m[1, :n // 8]).sum().item())
    flush()


def changed(ranges: list[tuple[int, int]], layout: list[tuple[int, int, int]],
            before: dict[Key, tuple[int, int]] | None) -> tuple[list[tuple[int, int]], dict]:
    """The ranges to copy and the hashes of this snapshot's blocks. To copy: the blocks whose
    hash is not the one in ``before``, and any live bytes outside the segments' blocks; every
    range when ``before`` is None."""
    items = blocks(ranges, layout)
    now = hashes(items)
    if before is None:
        return list(ranges), now
    copy: list[list[int]] = []

    def add(address: int, length: int) -> None:
        if copy and copy[-1][0] + copy[-1][1] >= address:
            copy[-1][1] = max(copy[-1][1], address + length - copy[-1][0])
        else:
            copy.append([address, length])

    covered = sum(n for _, _, n, _ in items)
    if covered != sum(n for _, n in ranges):  # not all inside segments on the GPU: copy all
        return list(ranges), now
    for key, address, n, _ in items:
        if key not in now or before.get(key) != now[key]:
            add(address, n)
    return [(a, n) for a, n in copy], now
