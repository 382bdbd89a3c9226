"""Move a sealed object (an encrypted remote's pack) between a plaintext file and the bucket,
in parallel parts, sealing and opening on the way.

A part is a group of whole segments (the transfer's part size, 16 MiB; the first part also
carries the object's head: magic and salt). Parts are made and sent, or fetched and opened,
by the transfer's concurrency of threads (8): every byte crosses the network once and the
disk once, and at most a part per thread is held in memory.

* ``send_sealed``: each thread reads its segments from the file (``pread``), seals them and
  uploads the part (a multipart upload; one PUT for a small pack).
* ``fetch_sealed``: the head and the size come first, from one small ranged GET; then each
  thread fetches its part by a ranged GET, opens each segment as it arrives and writes the
  plaintext at its place (``pwrite``). Segments open in any order and the last one is marked
  (crypto.py), so a truncated, reordered or mixed-in object still fails: NotAuthentic, which
  the caller turns into a refusal naming the pack.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import fsutil
from .crypto import (
    HEAD,
    SEGMENT,
    STEP,
    TAG,
    NotAuthentic,
    RepoKey,
    sealed_size,
    segment_count,
    segments_of,
)
from .s3 import S3Bucket, run_parallel


def _group(bucket: S3Bucket) -> int:
    """Segments per part."""
    return max(1, bucket.transfer.multipart_chunksize // SEGMENT)


def send_sealed(bucket: S3Bucket, key: RepoKey, kind: str, name: str, path: Path) -> int:
    """Upload the file at ``path`` sealed as the object ``name`` of ``kind``; the bytes
    sent. OSError if the file changes size meanwhile (nothing is left under ``name``)."""
    sealer = key.sealer(kind, name)
    group = _group(bucket)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        count = segments_of(size)

        def part(k: int) -> bytearray:
            first, stop = k * group, min((k + 1) * group, count)
            at = HEAD if k == 0 else 0
            out = bytearray(at + min(stop * SEGMENT, size) - first * SEGMENT
                            + (stop - first) * TAG)
            out[:at] = sealer.head[:at]
            view, buf = memoryview(out), memoryview(bytearray(SEGMENT))
            for i in range(first, stop):  # read a segment, seal it into its place
                n = min(SEGMENT, size - i * SEGMENT)
                if os.preadv(fd, [buf[:n]], i * SEGMENT) != n:
                    raise OSError(f"{path} changed size while being sealed")
                dst = at + (i - first) * STEP
                sealer.seal_into(i, count, buf[:n], view[dst:dst + n + TAG])
            return out

        bucket.upload_parts(name, -(-count // group), part)
        if os.fstat(fd).st_size != size:
            bucket.delete(name)
            raise OSError(f"{path} changed size while being sealed")
    finally:
        os.close(fd)
    return sealed_size(size)


def fetch_sealed(bucket: S3Bucket, key: RepoKey, kind: str, name: str, dest: Path) -> int:
    """Write the plaintext of the sealed object ``name`` of ``kind`` to ``dest`` (created
    or emptied, mode 0600); returns the sealed size. NotAuthentic if any of it does not
    open; the store's remote errors when the bucket fails."""
    head, size = next(bucket.read_range(name, 0, HEAD, HEAD), (b"", 0))
    opener = key.opener(kind, name, head)
    count = segment_count(size)
    group = _group(bucket)
    fd = fsutil.open_private(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        def fetch(k: int) -> None:
            first = k * group
            start = HEAD + first * STEP
            stop = min(HEAD + (first + group) * STEP, size)
            i = first
            for seg, total in bucket.read_range(name, start, stop, STEP):
                if total != size:
                    raise NotAuthentic("the object changed while it was downloaded")
                os.pwrite(fd, opener.open(i, count, seg), i * SEGMENT)
                i += 1
            if i != min(first + group, count):
                raise NotAuthentic("truncated")

        run_parallel(fetch, range(-(-count // group)), bucket.transfer.max_concurrency)
    finally:
        os.close(fd)
    return size


__all__ = ["fetch_sealed", "send_sealed"]
