"""Download a sealed object (an encrypted remote's pack) straight into its plaintext file.

The object's head (magic and salt) and size come first, from one small ranged GET. Then
groups of whole segments (the transfer's part size, 16 MiB) are fetched by ranged GETs in
parallel (the transfer's concurrency, 8), each segment opened as it arrives and its plaintext
written at its place in the file (``pwrite``): every byte crosses the network once and the
disk once, and at most one segment per worker is held in memory. Segments open in any order,
and the last one is marked (crypto.py), so a truncated, reordered or mixed-in object still
fails: NotAuthentic, which the caller turns into a refusal naming the pack.
"""

from __future__ import annotations

import os
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

from . import fsutil
from .crypto import HEAD, SEGMENT, STEP, NotAuthentic, RepoKey, segment_count
from .s3 import S3Bucket


def fetch_sealed(bucket: S3Bucket, key: RepoKey, kind: str, name: str, dest: Path) -> int:
    """Write the plaintext of the sealed object ``name`` of ``kind`` to ``dest`` (created
    or emptied, mode 0600); returns the sealed size. NotAuthentic if any of it does not
    open; the store's remote errors when the bucket fails."""
    head, size = next(bucket.read_range(name, 0, HEAD, HEAD), (b"", 0))
    opener = key.opener(kind, name, head)
    count = segment_count(size)
    group = max(1, bucket.transfer.multipart_chunksize // SEGMENT)
    fd = fsutil.open_private(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        def fetch(first: int) -> None:
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

        firsts = range(0, count, group)
        workers = max(1, min(bucket.transfer.max_concurrency, len(firsts)))
        with ThreadPoolExecutor(workers, thread_name_prefix="ij-fetch") as pool:
            done, pending = wait([pool.submit(fetch, f) for f in firsts],
                                 return_when=FIRST_EXCEPTION)
            for f in pending:
                f.cancel()
            for f in done:
                f.result()  # the first failure, raised
    finally:
        os.close(fd)
    return size


__all__ = ["fetch_sealed"]
