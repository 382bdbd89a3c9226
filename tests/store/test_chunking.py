"""Chunkers: cut points are content-defined, bounded, and independent of read sizes."""

from __future__ import annotations

import pytest
from conftest import CHUNKERS, page_image, random_bytes

from infinijup.store.chunking import ChunkerParams, chunk_lengths, make_chunker
from infinijup.store.errors import UnsupportedFormat


def chunks(params: ChunkerParams, data: bytes, block: int = 8 << 20) -> list[bytes]:
    out, pos = [], 0
    for n in chunk_lengths(make_chunker(params), data, block):
        out.append(data[pos : pos + n])
        pos += n
    assert pos == len(data)
    return out


@pytest.mark.parametrize("name", sorted(CHUNKERS))
def test_bounds_and_block_independence(name: str) -> None:
    p = CHUNKERS[name]
    data = bytes(page_image(1024, seed=3)) + random_bytes(12345, seed=4)
    cuts = chunks(p, data)
    assert all(len(c) <= p.max_size for c in cuts)
    assert all(len(c) >= p.min_size for c in cuts[:-1])
    assert 0.5 * p.avg_size <= len(data) / len(cuts) <= 3 * p.avg_size
    for block in (4096, 65536, 1 << 20, 3 * 4096 * 7):  # same cuts whatever the read size
        assert chunks(p, data, block) == cuts


@pytest.mark.parametrize("name", ["pagecdc", "fastcdc"])
def test_content_defined_resync_after_insert(name: str) -> None:
    p = CHUNKERS[name]
    data = bytes(page_image(2048, seed=5))
    changed = data[: 700 * 4096] + random_bytes(3 * 4096, seed=6) + data[700 * 4096 :]
    before, after = set(chunks(p, data)), chunks(p, changed)
    new = sum(len(c) for c in after if c not in before)
    assert new < 4 * p.max_size


def test_pagecdc_cuts_on_pages_and_fixed_is_fixed() -> None:
    data = random_bytes(3 << 20, seed=7)
    assert all(len(c) % 4096 == 0 for c in chunks(CHUNKERS["pagecdc"], data))
    sizes = [len(c) for c in chunks(CHUNKERS["fixed"], data + b"xyz")]
    assert sizes[:-1] == [32768] * (len(sizes) - 1) and sizes[-1] == 3


def test_small_and_empty_inputs() -> None:
    for p in CHUNKERS.values():
        assert chunks(p, b"") == []
        assert chunks(p, b"abc") == [b"abc"]


@pytest.mark.parametrize("bad", [
    {"algorithm": "nope"},
    {"algorithm": "pagecdc", "min_size": 1000, "avg_size": 4096, "max_size": 8192},
    {"algorithm": "fastcdc", "min_size": 100, "avg_size": 50, "max_size": 200},
    {"algorithm": "fixed", "min_size": 4096, "avg_size": 12288, "max_size": 12288},
    {"algorithm": "fastcdc", "surprise": 1},
])
def test_bad_parameters_are_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(UnsupportedFormat):
        ChunkerParams.from_dict(bad)
