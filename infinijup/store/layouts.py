"""Blob layouts: where each chunk of a large blob starts, known without looking every chunk up
in the index (issue 32).

A restore that serves a kernel's page files from the store (engine/store_pages.py) must know
where each chunk of a page file starts before it can answer its first ask, and a blob lists
only its chunks' ids. Looking up every chunk of a 16 GiB page file (448 K chunks) took 2.4-3.0 s
on the 2-core VM. So the writer that stores a blob of ``MIN_CHUNKS`` or more records its chunks'
lengths in the index (``layouts``), and a reader gets the starts from one row; the chunks'
locations can then be looked up as they are needed, or behind.

A layout is a cache, like the rest of the index: none after ``rebuild-index``, none for blobs
that came from a remote, none in an encrypted store (the order of a blob's chunk lengths is
not in the clear there). Without one, a reader looks every chunk up, as before. A layout is
checked against its blob (count and total) before use, and each chunk's length against its
index row when the chunk is read.
"""

from __future__ import annotations

import numpy as np
import zstandard

MIN_CHUNKS = 1024  # smaller blobs are looked up quickly enough


def encode(ends: np.ndarray) -> bytes:
    """The compressed lengths of chunks ending at ``ends`` (stream offsets, in order)."""
    lengths = np.diff(np.asarray(ends, dtype=np.int64), prepend=0)
    return zstandard.ZstdCompressor(level=3).compress(lengths.astype("<u4").tobytes())


def starts(data: bytes | None, count: int, size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(starts, lengths) of a blob's ``count`` chunks from its recorded layout, or None when
    there is none or it does not fit the blob (``size`` bytes in all)."""
    if data is None:
        return None
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=4 * count)
    except zstandard.ZstdError:
        return None
    if len(raw) != 4 * count:
        return None
    lengths = np.frombuffer(raw, dtype="<u4").astype(np.int64)
    ends = np.cumsum(lengths)
    if count == 0 or int(ends[-1]) != size:
        return None
    return ends - lengths, lengths


def known_ends(repo, blob_id: str, count: int, size: int) -> np.ndarray | None:  # noqa: ANN001
    """Where each of the blob's ``count`` chunks ends, from its recorded layout; None without
    one (an encrypted store records none)."""
    if getattr(repo, "key", None) is not None:
        return None
    known = starts(repo.index.layout(bytes.fromhex(blob_id)), count, size)
    return None if known is None else known[0] + known[1]
