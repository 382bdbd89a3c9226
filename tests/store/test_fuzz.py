"""Fuzzing the parsers: any input gives a value or one of the store's own errors."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
