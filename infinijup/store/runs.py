"""Runs of a file's chunks as checkout reads them: one ``preadv`` of a run's stored bytes,
its zstd chunks decompressed a few at a time, every chunk of a plain store BLAKE3-verified,
one ``pwritev``. Shared by checkout's threads (checkout.py) and its worker processes
(checkout_workers.py)."""

from __future__ import annotations

import array
import os
import threading
from collections.abc import Callable
from typing import Any

import blake3
import zstandard

from .errors import ChecksumMismatch
from .packs import ZSTD, pwritev_all

RUN_MAX = 4 << 20  # stored (and raw) bytes of one run: one preadv, one pwritev
# Plaintext bytes per decompression call: one call per group releases the GIL once for
# several chunks, and its output buffer stays small enough for malloc to recycle (a fresh
# multi-MiB output per run costs page faults, one per 4 KiB: measured per GB checked out,
# ~28K faults at 128 KiB against ~100K at 256 KiB and 150K-270K with one call per run).
DECOMPRESS_GROUP = 128 << 10

#: One chunk of a run: (id, stored length, raw length, compression).
Item = tuple[bytes, int, int, int]
#: One run: (pack, offset in the pack, stored bytes, offset in the file, its chunks).
Run = tuple[str, int, int, int, list[Item]]


class RunDecoder:
    """Reads, decodes and verifies runs, with a read buffer and a zstd context per thread
    (a checkout's threads share one; a worker process has its own)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def read(self, pack_fd: int, pack: str, start: int, stored: int,
             items: list[Item]) -> memoryview:
        """A run's stored bytes, in this thread's buffer; a short read names its object."""
        buf = self.buffer(stored)
        got = os.preadv(pack_fd, [buf], start)
        if got < stored:
            pos = 0
            for cid, length, _raw, _comp in items:
                pos += length
                if pos > got:
                    raise ChecksumMismatch(f"object {cid.hex()} in pack {pack}: short read")
        return buf

    def decode(self, buf: memoryview, pack: str, items: list[Item]
               ) -> list[Any]:
        """The plaintexts of a run read into ``buf`` (not yet verified): raw chunks are
        views of ``buf``; zstd chunks are decompressed a group at a time, in one call per
        group that releases the GIL once (``multi_decompress_to_buffer``)."""
        out: list[Any] = []
        group: list[int] = []  # indexes of the zstd chunks of the current group
        group_raw = 0
        pos = 0
        for k, (_cid, length, raw, comp) in enumerate(items):
            if comp == ZSTD:
                if group and group_raw + raw > DECOMPRESS_GROUP:
                    self._decompress(buf, pack, items, group, out)
                    group, group_raw = [], 0
                group.append(k)
                group_raw += raw
                out.append(pos)  # replaced by the plaintext
            else:
                out.append(buf[pos : pos + length])
            pos += length
        if group:
            self._decompress(buf, pack, items, group, out)
        return out

    def _decompress(self, buf: memoryview, pack: str, items: list[Item],
                    group: list[int], out: list[Any]) -> None:
        """Decompress the zstd chunks ``group`` of a run (``out[k]`` holds each one's offset
        in ``buf``) into ``out``."""
        frames = array.array("Q")  # (offset, length) of each frame in buf
        sizes = array.array("Q")
        for k in group:
            frames.append(out[k])
            frames.append(items[k][1])
            sizes.append(items[k][2])
        dctx = self._dctx()
        try:
            plain = dctx.multi_decompress_to_buffer(
                zstandard.BufferWithSegments(buf, frames.tobytes()),
                decompressed_sizes=sizes.tobytes(), threads=1)
        except zstandard.ZstdError:  # find and name the damaged object
            for k in group:
                cid, length, raw, _comp = items[k]
                try:
                    dctx.decompress(buf[out[k] : out[k] + length], max_output_size=raw)
                except zstandard.ZstdError as exc:
                    raise ChecksumMismatch(f"object {cid.hex()} in pack {pack}: does not "
                                           f"decompress ({exc})") from exc
            raise ChecksumMismatch(f"pack {pack}: the objects from {items[group[0]][0].hex()} "
                                   "on do not decompress together") from None
        for j, k in enumerate(group):
            out[k] = plain[j]

    def _dctx(self) -> zstandard.ZstdDecompressor:
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstandard.ZstdDecompressor()
        return dctx

    def buffer(self, size: int) -> memoryview:
        """A per-thread read buffer of at least ``size`` bytes, reused across runs."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:  # a run ends past RUN_MAX by up to one chunk
            buf = self._local.buf = memoryview(bytearray(max(size, 2 * RUN_MAX)))
        return buf[:size]


def verify(pack: str, items: list[Item], out: list[Any]) -> None:
    """A plain store's chunks of one run, decoded: each one's BLAKE3 is its id."""
    for (cid, _length, raw, _comp), data in zip(items, out, strict=True):
        if len(data) != raw or blake3.blake3(data).digest() != cid:
            raise ChecksumMismatch(f"object {cid.hex()} in pack {pack}: checksum mismatch")


def write_plain_runs(dec: RunDecoder, fd: int, runs: list[Run],
                     pack_fd: Callable[[str], int]) -> None:
    """Read, decode, verify and write ``runs`` of a plain store (none a delta) into ``fd``."""
    for pack, start, stored, file_offset, items in runs:
        buf = dec.read(pack_fd(pack), pack, start, stored, items)
        out = dec.decode(buf, pack, items)
        verify(pack, items, out)
        pwritev_all(fd, out, file_offset)
