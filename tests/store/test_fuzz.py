"""Fuzzing the parsers: any input gives a value or one of the store's own errors."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infinijup.store import delta
from infinijup.store.errors import StoreError
from infinijup.store.index import Index
from infinijup.store.objects import BLOB, CHUNK, decode_blob, decode_commit, decode_tree, hash_bytes
from infinijup.store.packs import (
    RAW,
    TRAILER,
    TRAILER_MAGIC,
    PackEntry,
    decode_payload,
    encode_header,
    parse_header,
    read_pack_entries,
)
from infinijup.store.repository import StoreConfig

FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def valid_pack(objects: list[bytes]) -> bytes:
    entries, offset = [], 0
    for i, data in enumerate(objects):
        entries.append(PackEntry(CHUNK if i % 2 else BLOB, RAW, hash_bytes(data), offset,
                                 len(data), len(data)))
        offset += len(data)
    header = encode_header(entries)
    return b"".join(objects) + header + TRAILER.pack(len(header), TRAILER_MAGIC)


@FUZZ
@given(st.binary(max_size=400), st.integers(0, 1000))
def test_parse_header_random(data: bytes, length: int) -> None:
    try:
        parse_header(data, length)
    except StoreError:
        pass


@FUZZ
@given(st.lists(st.binary(max_size=50), min_size=1, max_size=5), st.data())
def test_mutated_pack_files(tmp_path: Path, objects: list[bytes], data: st.DataObject) -> None:
    raw = bytearray(valid_pack(objects))
    op = data.draw(st.sampled_from(["flip", "truncate", "extend", "none"]))
    if op == "flip":
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
    elif op == "truncate":
        del raw[data.draw(st.integers(0, len(raw) - 1)) :]
    elif op == "extend":
        raw += data.draw(st.binary(min_size=1, max_size=20))
    path = tmp_path / "p"
    path.write_bytes(bytes(raw))
    try:
        entries = read_pack_entries(path)
    except StoreError:
        return
    for e in entries:  # whatever the header says, reading yields data or ChecksumMismatch
        try:
            decode_payload(bytes(raw[e.offset : e.offset + e.length]), e.id, e.compression,
                           e.raw_length, "x")
        except StoreError:
            pass
    if op == "none":
        assert [e.id for e in entries] == [hash_bytes(o) for o in objects]


@FUZZ
@given(st.binary(max_size=300))
def test_object_decoders_random_bytes(data: bytes) -> None:
    for decode in (decode_tree, decode_blob, lambda d: decode_commit("0" * 64, d)):
        try:
            decode(data)
        except StoreError:
            pass


def valid_delta(literal: bytes, zstd: bool) -> tuple[bytes, int]:
    import zstandard
    stored = zstandard.ZstdCompressor().compress(literal) if zstd and literal else literal
    runs = [(0, 4096, 0), (delta.ZEROS, 100, 0), (1, 50, 10)]
    if literal:
        runs.insert(1, (delta.LITERAL, len(literal), 0))
    return (delta.encode([b"a" * 32, b"b" * 32], runs, stored, zstd and bool(literal),
                         len(literal)), 4096 + 150 + len(literal))


@FUZZ
@given(st.binary(max_size=300), st.booleans(), st.data())
def test_mutated_delta_payloads(literal: bytes, zstd: bool, data: st.DataObject) -> None:
    import zstandard
    payload, raw = valid_delta(literal, zstd)
    buf = bytearray(payload)
    op = data.draw(st.sampled_from(["flip", "truncate", "extend", "none"]))
    if op == "flip":
        buf[data.draw(st.integers(0, len(buf) - 1))] ^= data.draw(st.integers(1, 255))
    elif op == "truncate":
        del buf[data.draw(st.integers(0, len(buf) - 1)) :]
    elif op == "extend":
        buf += data.draw(st.binary(min_size=1, max_size=20))
    sources = {b"a" * 32: bytes(range(256)) * 16, b"b" * 32: b"\7" * 60}
    try:  # any input: the plaintext, or CorruptObject (a StoreError); never another error
        out = delta.apply(bytes(buf), raw, sources.__getitem__, zstandard.ZstdDecompressor())
    except StoreError:
        return
    except KeyError:  # a flipped source id: the reader reports it as a missing source
        assert op == "flip"
        return
    if op == "none":
        assert bytes(out) == sources[b"a" * 32] + literal + bytes(100) + b"\7" * 50


@FUZZ
@given(st.binary(max_size=200), st.integers(0, 10000))
def test_delta_parser_random_bytes(data: bytes, raw: int) -> None:
    for payload in (data, delta.MAGIC + data):
        try:
            delta.parse(payload, raw)
        except StoreError:
            pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=20)


@FUZZ
@given(st.dictionaries(st.sampled_from(["type", "entries", "parents", "tree", "created",
                                        "message", "thread", "metadata", "stats", "name",
                                        "kind", "mode", "blob", "size"]), json_values))
def test_object_decoders_structured_json(obj: dict[str, object]) -> None:
    import json
    for kind in ("tree", "commit"):
        data = json.dumps({**obj, "type": kind}).encode()
        try:
            (decode_tree if kind == "tree" else lambda d: decode_commit("0" * 64, d))(data)
        except StoreError:
            pass


@FUZZ
@given(st.binary(max_size=600))
def test_config_parser(data: bytes) -> None:
    try:
        StoreConfig.from_json(data)
    except StoreError:
        pass


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(min_size=1, max_size=2000))
def test_index_file_garbage(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "index.sqlite"
    for suffix in ("", "-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    path.write_bytes(data)
    try:
        idx = Index(path)
    except StoreError:
        return
    try:
        idx.commit_ids()
        idx.known([b"x" * 32])
    except StoreError:
        pass
    finally:
        idx.close()
