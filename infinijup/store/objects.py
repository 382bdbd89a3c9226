"""The store's object model: chunks, blobs, trees and commits, and their encodings.

* chunk: a piece of file content; id = BLAKE3(plaintext).
* blob: one file's content, the ordered list of its chunk ids (binary: ``IJB1``, u64 size,
  u32 count, then 32-byte ids); id = BLAKE3(encoding).
* tree: a directory, canonical JSON of its sorted entries; id = BLAKE3(encoding).
* commit: canonical JSON naming a tree, its parents, thread, message, metadata and stats;
  id = BLAKE3(encoding). Commits thus form a Merkle DAG.

Canonical JSON: sorted keys, no whitespace, UTF-8, no NaN/Infinity. Every decoder checks
the shape of what it reads and raises :class:`CorruptObject` (never a bare KeyError).
"""

from __future__ import annotations

import json
import math
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import blake3

from .errors import CorruptObject, InvalidTree

ID_BYTES = 32
ID_HEX = 64

# Object types as recorded in pack headers and the index.
CHUNK, BLOB, TREE = 1, 2, 3
TYPE_NAMES = {CHUNK: "chunk", BLOB: "blob", TREE: "tree"}

_BLOB_MAGIC = b"IJB1"
_BLOB_HEAD = struct.Struct("<4sQI")


def hash_bytes(data: bytes | memoryview) -> bytes:
    """BLAKE3 digest (32 bytes) of ``data``."""
    return blake3.blake3(data).digest()


def canonical_json(value: Any) -> bytes:
    """The canonical JSON encoding used for hashing commits and trees."""
    try:
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise InvalidTree(f"value is not JSON-serializable: {exc}") from exc


def is_hex_id(text: str) -> bool:
    """Whether ``text`` is a full lower-case hex object id."""
    return len(text) == ID_HEX and all(c in "0123456789abcdef" for c in text)


@dataclass(frozen=True)
class Blob:
    """A stored file content: its blob object id and logical size in bytes."""

    id: str
    size: int


@dataclass(frozen=True)
class File:
    """A tree entry for a regular file: content and permission bits."""

    blob: Blob
    mode: int = 0o644


@dataclass(frozen=True)
class Symlink:
    """A tree entry for a symbolic link."""

    target: str


@dataclass(frozen=True)
class TreeEntry:
    """One decoded entry of a stored tree.

    ``kind`` is ``file`` (``id`` = blob id, ``size``), ``dir`` (``id`` = tree id) or
    ``symlink`` (``target``).
    """

    name: str
    kind: str
    mode: int = 0
    id: str = ""
    size: int = 0
    target: str = ""

    def to_json(self) -> dict[str, Any]:
        """Encoding of this entry inside a tree object."""
        if self.kind == "file":
            return {"name": self.name, "kind": "file", "mode": self.mode, "blob": self.id,
                    "size": self.size}
        if self.kind == "dir":
            return {"name": self.name, "kind": "dir", "mode": self.mode, "tree": self.id}
        return {"name": self.name, "kind": "symlink", "target": self.target}


#: What ``commit_tree`` accepts per name: a blob (mode 0644), a File, a Symlink, or a
#: nested mapping (a sub-directory, mode 0755).
EntryInput = Blob | File | Symlink | Mapping[str, Any]


@dataclass(frozen=True)
class Commit:
    """A snapshot: a tree plus history and metadata. ``id`` is BLAKE3 of its encoding."""

    id: str
    parents: tuple[str, ...]
    tree: str
    created: float
    message: str
    metadata: dict[str, Any] = field(hash=False)
    thread: str
    stats: dict[str, Any] = field(hash=False)

    def to_json(self) -> dict[str, Any]:
        """The JSON content that is hashed into the id (everything but the id)."""
        return {
            "type": "commit",
            "version": 1,
            "parents": list(self.parents),
            "tree": self.tree,
            "created": self.created,
            "message": self.message,
            "metadata": self.metadata,
            "thread": self.thread,
            "stats": self.stats,
        }

    @property
    def short_id(self) -> str:
        """The first 12 hex digits of the id."""
        return self.id[:12]


def check_name(name: str) -> str:
    """Validate one path component for a tree entry."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name:
        raise InvalidTree(f"invalid entry name {name!r}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidTree(f"entry name {name!r} is not valid UTF-8") from exc
    return name


def encode_tree(entries: list[TreeEntry]) -> bytes:
    """Canonical encoding of a tree (entries sorted by UTF-8 name)."""
    ordered = sorted(entries, key=lambda e: e.name.encode("utf-8"))
    names = [e.name for e in ordered]
    if len(set(names)) != len(names):
        raise InvalidTree("duplicate entry names in tree")
    return canonical_json({"type": "tree", "entries": [e.to_json() for e in ordered]})


def decode_tree(data: bytes) -> list[TreeEntry]:
    """Parse a tree object; raise CorruptObject on any malformation."""
    obj = _load_json(data, "tree")
    raw = obj.get("entries")
    if not isinstance(raw, list):
        raise CorruptObject("tree object has no entry list")
    out: list[TreeEntry] = []
    for item in raw:
        if not isinstance(item, dict):
            raise CorruptObject("tree entry is not an object")
        name, kind = item.get("name"), item.get("kind")
        try:
            check_name(name)
        except InvalidTree as exc:
            raise CorruptObject(str(exc)) from exc
        if kind == "file":
            out.append(TreeEntry(name, "file", _int(item, "mode"), _hex(item, "blob"),
                                 _int(item, "size")))
        elif kind == "dir":
            out.append(TreeEntry(name, "dir", _int(item, "mode"), _hex(item, "tree")))
        elif kind == "symlink":
            target = item.get("target")
            if not isinstance(target, str):
                raise CorruptObject("symlink entry without target")
            out.append(TreeEntry(name, "symlink", target=target))
        else:
            raise CorruptObject(f"unknown tree entry kind {kind!r}")
    return out


def encode_blob(size: int, chunk_ids: list[bytes]) -> bytes:
    """Binary encoding of a blob: total size and chunk ids in order."""
    return _BLOB_HEAD.pack(_BLOB_MAGIC, size, len(chunk_ids)) + b"".join(chunk_ids)


def decode_blob(data: bytes) -> tuple[int, list[bytes]]:
    """Parse a blob object into (size, chunk ids)."""
    if len(data) < _BLOB_HEAD.size:
        raise CorruptObject("blob object too short")
    magic, size, count = _BLOB_HEAD.unpack_from(data)
    if magic != _BLOB_MAGIC:
        raise CorruptObject("blob object has a bad magic")
    body = memoryview(data)[_BLOB_HEAD.size :]
    if len(body) != count * ID_BYTES:
        raise CorruptObject("blob object length does not match its chunk count")
    return size, [bytes(body[i : i + ID_BYTES]) for i in range(0, len(body), ID_BYTES)]


def encode_commit(commit: Commit) -> bytes:
    """Canonical encoding of a commit (its id is BLAKE3 of these bytes)."""
    return canonical_json(commit.to_json())


def decode_commit(commit_id: str, data: bytes) -> Commit:
    """Parse a commit object; the caller has verified that ``data`` hashes to ``commit_id``."""
    obj = _load_json(data, "commit")
    parents = obj.get("parents")
    created = obj.get("created")
    if not isinstance(parents, list) or not all(isinstance(p, str) and is_hex_id(p)
                                                for p in parents):
        raise CorruptObject(f"commit {commit_id}: bad parents")
    if isinstance(created, bool) or not isinstance(created, (int, float)) \
            or not math.isfinite(created):
        raise CorruptObject(f"commit {commit_id}: bad created time")
    fields = {k: obj.get(k) for k in ("message", "thread")}
    if not all(isinstance(v, str) for v in fields.values()):
        raise CorruptObject(f"commit {commit_id}: message/thread must be strings")
    metadata, stats = obj.get("metadata"), obj.get("stats")
    if not isinstance(metadata, dict) or not isinstance(stats, dict):
        raise CorruptObject(f"commit {commit_id}: metadata/stats must be objects")
    return Commit(
        id=commit_id,
        parents=tuple(parents),
        tree=_hex(obj, "tree"),
        created=float(created),
        message=fields["message"],
        metadata=metadata,
        thread=fields["thread"],
        stats=stats,
    )


def mode_bits(mode: int) -> int:
    """Permission bits (incl. setuid/setgid/sticky) of a st_mode."""
    return stat.S_IMODE(mode)


def _load_json(data: bytes, kind: str) -> dict[str, Any]:
    try:
        obj = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptObject(f"{kind} object is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict) or obj.get("type") != kind:
        raise CorruptObject(f"object is not a {kind}")
    return obj


def _int(obj: dict[str, Any], key: str) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise CorruptObject(f"field {key!r} must be a non-negative integer")
    return v


def _hex(obj: dict[str, Any], key: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or not is_hex_id(v):
        raise CorruptObject(f"field {key!r} must be a 64-digit hex id")
    return v
