"""The content-addressed snapshot store: ``Repository``.

On disk (every directory 0700, every file 0600)::

    config                 format version, chunker and compression parameters (JSON)
    packs/<xx>/<pack id>   chunk, blob and tree objects (see packs.py)
    commits/<xx>/<id>      one canonical-JSON commit per file, named by its BLAKE3
    refs/<quoted thread>   the tip commit id of each thread
    index.sqlite           the index (a rebuildable cache, WAL mode)
    lock, refs.lock        flock-based locks (see lock.py)
    tmp/                   packs being written

An encrypted store (format 3, ``init(encrypt=...)``; local_crypto.py) also has ``keys/`` and
``encryption``; its ids are keyed, its objects, pack headers, commit files and refs sealed,
its ref files named by keyed tokens, and the index holds sealed commits and keyed tokens
in place of threads and metadata. It is unlocked at open (``credentials``, else
``$INFINIJUP_STORE_PASSWORD_FILE`` / ``$INFINIJUP_STORE_KEY_FILE``).

A snapshot is written in the order packs -> index -> commit object -> ref, each step
durable (fsync) before the next, so a crash at any point leaves every earlier commit intact
and at worst some unreferenced garbage that ``gc`` removes.

Format versions: 1 (no page deltas) and 2 (chunks may be stored as page deltas of other
chunks, delta.py). Both are read; the first writer of a version-1 store upgrades its config
to 2 (code that reads only version 1 then refuses the store with UnsupportedFormat instead
of misreading it).

Writing, reading and threads are methods here. Checking out (checkout.py), verifying
(check.py), collecting garbage (gc.py) and rebuilding the index (rebuild.py) are functions
over a Repository (``checkout_dir(repo, ref, path)``, ``check(repo)``, ``gc(repo)``,
``rebuild_index(repo)``); this module imports none of them but rebuild.py, and the modules
it does import (reader, writer, rebuild, ...) see a repository as a ``repo_view.RepoView``,
so there is no import cycle in the store.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.parse
import uuid
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from . import fsutil, layout
from .chunking import ChunkerParams, make_chunker
from .config import VERSION, StoreConfig
from .errors import (
    AmbiguousRef,
    CorruptObject,
    InvalidRef,
    InvalidTree,
    ObjectMissing,
    RefConflict,
    StoreError,
    StoreExists,
    StoreNotFound,
    UnknownRef,
)
from .faults import crashpoint
from .index import Index
from .lock import DEFAULT_TIMEOUT, FileLock
from .objects import (
    BLOB,
    CHUNK,
    TREE,
    Commit,
    TreeEntry,
    canonical_json,
    decode_blob,
    decode_commit,
    decode_tree,
    encode_commit,
    hash_bytes,
    is_hex_id,
)
from .packs import DELTA
from .reader import ObjectReader
from .rebuild import rebuild_index
from .writer import Dir, Writer, entries_from_dir

if TYPE_CHECKING:
    from .keys import Credentials, KdfParams
    from .local_crypto import StoreKey

MIN_PREFIX = 8
_HEX = frozenset("0123456789abcdef")


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


#: Sentinel for "do not check" in compare-and-swap arguments.
UNSET: Any = _Unset()


def default_store_path() -> Path:
    """``$INFINIJUP_STORE`` if set, else ``~/.local/share/infinijup/store``."""
    env = os.environ.get("INFINIJUP_STORE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".local" / "share" / "infinijup" / "store"


class Repository:
    """A snapshot store on local disk. Safe for threads and processes (see lock.py)."""

    def __init__(self, path: Path, config: StoreConfig, *,
                 lock_timeout: float = DEFAULT_TIMEOUT, key: StoreKey | None = None) -> None:
        """Use :meth:`open`, :meth:`init` or :meth:`open_or_init` instead."""
        self.path = path
        self.config = config
        self.key = key  # an encrypted store's keys (None: a plain store)
        self.lock_timeout = lock_timeout
        self.chunker = make_chunker(config.chunker)
        self.packs_dir = path / "packs"
        self.commits_dir = path / "commits"
        self.refs_dir = path / "refs"
        self.tmp_dir = path / "tmp"
        self.lock_path = path / "lock"
        self.refs_lock_path = path / "refs.lock"
        self.index_path = path / "index.sqlite"
        self._index: Index | None = None
        self._index_lock = threading.Lock()

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def init(cls, path: str | os.PathLike[str], *, chunker: ChunkerParams | None = None,
             compression_level: int = 1, pack_size: int = 128 << 20,
             page_deltas: bool = True, lock_timeout: float = DEFAULT_TIMEOUT,
             encrypt: Credentials | None = None, kdf: KdfParams | None = None) -> Repository:
        """Create a new store at ``path`` (absent or an empty directory) and open it.

        ``page_deltas=False`` stores every new chunk whole (as format 1 did). ``encrypt``
        (a password and/or key file) makes an encrypted store, its first key slot opened by
        them (``kdf``: the password's Argon2id parameters)."""
        root = Path(path).expanduser()
        if (root / "config").exists():
            raise StoreExists(f"a store already exists at {root}")
        if root.exists() and (not root.is_dir() or any(root.iterdir())):
            raise StoreExists(f"{root} exists and is not an empty directory")
        fsutil.make_private_dir(root)
        for sub in ("packs", "commits", "refs", "tmp"):
            fsutil.make_private_dir(root / sub)
        key = None
        if encrypt is not None:
            from .local_crypto import init_keys  # keys and crypto only where needed

            key = init_keys(root, encrypt, label="init", kdf=kdf).key
        config = StoreConfig(uuid.uuid4().hex, chunker or ChunkerParams(), compression_level,
                             pack_size=pack_size, page_deltas=page_deltas,
                             encrypted=key is not None)
        StoreConfig.from_json(config.to_json())  # validate before writing
        tmp = fsutil.temp_name(root, "config")
        fd = fsutil.open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            os.write(fd, config.to_json())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, root / "config")  # fails if a concurrent init won
        except FileExistsError:
            raise StoreExists(f"a store already exists at {root}") from None
        finally:
            os.unlink(tmp)
        fsutil.fsync_dir(root)
        repo = cls(root, config, lock_timeout=lock_timeout, key=key)
        repo.index.commit_count()  # create the index file now
        return repo

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, lock_timeout: float = DEFAULT_TIMEOUT,
             credentials: Credentials | None = None) -> Repository:
        """Open an existing store. A missing index is rebuilt from the packs. An encrypted
        store is unlocked with ``credentials`` (default: from the environment); a wrong or
        missing key is StoreWrongKey."""
        root = Path(path).expanduser()
        try:
            data = (root / "config").read_bytes()
        except FileNotFoundError:
            raise StoreNotFound(f"no infinijup store at {root}") from None
        except NotADirectoryError:
            raise StoreNotFound(f"no infinijup store at {root}") from None
        config = StoreConfig.from_json(data)
        key = None
        if config.encrypted:
            from .keys import Credentials
            from .local_crypto import open_keys

            key = open_keys(root, credentials or Credentials.from_env()).key
        repo = cls(root, config, lock_timeout=lock_timeout, key=key)
        if not repo.index_path.exists():
            rebuild_index(repo)
        return repo

    @classmethod
    def open_or_init(cls, path: str | os.PathLike[str], **kwargs: Any) -> Repository:
        """Open the store at ``path``, creating it first if there is none."""
        try:
            return cls.open(path, **_open_args(kwargs))
        except StoreNotFound:
            pass
        try:
            return cls.init(path, **{k: v for k, v in kwargs.items() if k != "credentials"})
        except StoreExists:
            return cls.open(path, **_open_args(kwargs))

    @property
    def index(self) -> Index:
        """The SQLite index (opened on first use)."""
        with self._index_lock:
            if self._index is None:
                self._index = Index(self.index_path, key=self.key)
            return self._index

    def close(self) -> None:
        """Close the index connection."""
        with self._index_lock:
            if self._index is not None:
                self._index.close()
                self._index = None

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Repository({str(self.path)!r})"

    # -- writing ---------------------------------------------------------------------------

    def writer(self, *, threads: int | None = None) -> Writer:
        """A streaming writer (context manager). ``threads`` defaults to one per core, at
        most 8 (``writer.default_threads``)."""
        self._upgrade()
        return Writer(self, threads=threads)

    def _upgrade(self) -> None:
        """Move a version-1 store to the current format before writing to it (the config
        is rewritten atomically; every writer would write the same bytes)."""
        if self.config.version >= VERSION:
            return
        config = replace(self.config, version=VERSION, page_deltas=True)
        fsutil.atomic_write(self.path / "config", config.to_json(), tmp_dir=self.tmp_dir)
        self.config = config

    def commit_tree(self, entries: Mapping[str, Any], *, thread: str, message: str = "",
                    metadata: dict[str, Any] | None = None, parents: list[str] | None = None,
                    expected_tip: str | None = UNSET, writer: Writer | None = None) -> Commit:
        """Commit a tree built from ``entries`` (name -> Blob/File/Symlink/Dir/mapping).

        ``parents`` None means the thread's current tip (if any). The thread ref is moved
        with compare-and-swap: if ``expected_tip`` is given (a commit id, or None for "the
        thread must not exist") and the tip differs, RefConflict is raised and the ref is
        left alone. Pass the ``writer`` that stored the blobs to get full stats.
        """
        own = writer is None
        w = writer if writer is not None else self.writer(threads=1)
        try:
            tree_id, image_bytes = w.add_tree(entries)
            w.flush()
            ws = w.take_stats()
            stats = {"image_bytes": image_bytes, "stored_bytes": ws.stored_bytes,
                     "files": ws.files, "chunks": ws.chunks, "new_chunks": ws.new_chunks,
                     "delta_chunks": ws.delta_chunks, "read_bytes": ws.read_bytes}
            return self._commit(tree_id, thread=thread, message=message,
                                metadata=metadata or {}, parents=parents,
                                expected_tip=expected_tip, stats=stats)
        except BaseException:
            if own:
                w.abort()
            raise
        finally:
            if own:
                w.close()

    def commit_dir(self, path: str | os.PathLike[str], *, thread: str, message: str = "",
                   metadata: dict[str, Any] | None = None, parents: list[str] | None = None,
                   expected_tip: str | None = UNSET, threads: int | None = None) -> Commit:
        """Snapshot the directory at ``path`` (files, sub-directories, symlinks, modes).

        Each file is stored against the same path in the first parent (the thread's tip by
        default): chunks that changed in a few pages become page deltas (delta.py).
        """
        root = Path(path)
        if not root.is_dir():
            raise InvalidTree(f"{root} is not a directory")
        with self.writer(threads=threads) as w:
            top = entries_from_dir(w, root, self._base_tree(parents, thread))
            return w.commit(top.entries, thread=thread, message=message, metadata=metadata,
                            parents=parents, expected_tip=expected_tip)

    def _base_tree(self, parents: list[str] | None, thread: str) -> str | None:
        """The tree of the commit a new snapshot is stored against (a hint: None if there
        is none or it cannot be read)."""
        if not self.config.page_deltas:
            return None
        try:
            if parents is not None:  # explicit parents; [] = a root commit: no base
                ref = parents[0] if parents else None
            else:
                ref = self._read_ref(thread) if _valid_thread_name(thread) else None
            return self.get_commit(ref).tree if ref else None
        except StoreError:
            return None

    def _commit(self, tree_id: str, *, thread: str, message: str, metadata: dict[str, Any],
                parents: list[str] | None, expected_tip: str | None, stats: dict[str, Any]
                ) -> Commit:
        _check_thread_name(thread)
        if not isinstance(message, str):
            raise InvalidTree("message must be a string")
        if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
            raise InvalidTree("metadata must be a dict with string keys")
        canonical_json(metadata)  # raises on values JSON cannot carry
        if parents is not None:
            parents = [self.resolve(p) for p in parents]
        with FileLock(self.refs_lock_path, timeout=self.lock_timeout):
            tip = self._read_ref(thread)
            if expected_tip is not UNSET and tip != expected_tip:
                raise RefConflict(
                    f"thread {thread!r} is at {tip or 'nothing'}, expected {expected_tip or 'nothing'}")
            if parents is None:
                parents = [tip] if tip else []
            draft = Commit("", tuple(parents), tree_id, time.time(), message, metadata, thread,
                           stats)
            body = encode_commit(draft)
            commit = Commit(self.object_id(body).hex(), draft.parents, tree_id, draft.created,
                            message, json.loads(canonical_json(metadata)), thread, stats)
            data = layout.commit_file_bytes(self.key, commit.id, body)
            fsutil.atomic_write(self._commit_path(commit.id), data, tmp_dir=self.tmp_dir)
            crashpoint("after_commit")
            self.index.add_commits([(commit, data)])
            crashpoint("before_ref")
            self._write_ref(thread, commit.id)
            crashpoint("after_ref")
        return commit

    # -- reading ---------------------------------------------------------------------------

    def object_id(self, data: bytes | memoryview) -> bytes:
        """The id of an object whose plaintext is ``data``: its BLAKE3 (keyed, in an
        encrypted store)."""
        return hash_bytes(data) if self.key is None else self.key.object_id(data)

    def read_object(self, oid: bytes) -> bytes:
        """The verified plaintext of object ``oid`` (raises ObjectMissing/ChecksumMismatch)."""
        with ObjectReader(self) as reader:
            loc = reader.locate(oid)
            try:
                reader.pack_fd(loc.pack)
            except ObjectMissing:
                raise ObjectMissing(f"object {oid.hex()}: pack {loc.pack} is missing") from None
            return reader.read(oid, loc)

    def get_tree(self, tree_id: str) -> list[TreeEntry]:
        """The entries of a tree object."""
        return decode_tree(self.read_object(bytes.fromhex(tree_id)))

    def get_blob_chunks(self, blob_id: str) -> tuple[int, list[bytes]]:
        """(size, chunk ids) of a blob object."""
        return decode_blob(self.read_object(bytes.fromhex(blob_id)))

    def read_blob(self, blob_id: str) -> bytes:
        """The whole content of a blob (for small files; use checkout.checkout_dir for images)."""
        size, chunks = self.get_blob_chunks(blob_id)
        data = b"".join(self.read_object(c) for c in chunks)
        if len(data) != size:
            raise CorruptObject(f"blob {blob_id}: chunks hold {len(data)} bytes, not {size}")
        return data

    def get_commit(self, ref: str) -> Commit:
        """The commit named by ``ref`` (id, unique prefix or thread), verified by hash."""
        commit_id = self.resolve(ref)
        return self._load_commit(commit_id)

    def _load_commit(self, commit_id: str) -> Commit:
        try:
            data = self._commit_path(commit_id).read_bytes()
        except FileNotFoundError:
            raise ObjectMissing(f"commit {commit_id} is missing") from None
        return decode_commit(commit_id, layout.commit_body(self.key, commit_id, data))

    def _commit_path(self, commit_id: str) -> Path:
        return self.commits_dir / commit_id[:2] / commit_id

    def resolve(self, ref: str) -> str:
        """Full commit id for ``ref``: a full id, a thread name, or an id prefix (>= 8 hex).

        Raises UnknownRef (no such commit/thread), AmbiguousRef (prefix matches several
        commits) or InvalidRef (empty, or a hex prefix shorter than 8 digits).
        """
        if not isinstance(ref, str) or not ref:
            raise InvalidRef("empty ref")
        if is_hex_id(ref):
            if self.index.has_commit(ref) or self._commit_path(ref).exists():
                return ref
            raise UnknownRef(f"no commit {ref}")
        if _valid_thread_name(ref):
            tip = self._read_ref(ref)
            if tip is not None:
                return tip
        low = ref.lower()
        if set(low) <= _HEX and len(low) < 64:
            if len(low) < MIN_PREFIX:
                raise InvalidRef(
                    f"{ref!r} is neither a thread nor a usable id prefix "
                    f"(prefixes need at least {MIN_PREFIX} hex digits)")
            found = self.index.commits_with_prefix(low, limit=3)
            if len(found) > 1:
                raise AmbiguousRef(f"prefix {ref!r} matches several commits: "
                                   + ", ".join(f[:12] for f in found))
            if found:
                return found[0]
        raise UnknownRef(f"no thread or commit named {ref!r}")

    def log(self, thread: str | None = None) -> list[Commit]:
        """Commits newest first: every ancestor of ``thread``'s tip, or (None) all commits."""
        if thread is None:
            return [self._load_commit(c) for c in self.index.commit_ids()]
        tip = self._read_ref(thread)
        if tip is None:
            raise UnknownRef(f"no thread {thread!r}")
        seen: dict[str, Commit] = {}
        stack = [tip]
        while stack:
            cid = stack.pop()
            if cid in seen:
                continue
            c = self._load_commit(cid)
            seen[cid] = c
            stack.extend(p for p in c.parents if p not in seen)
        return sorted(seen.values(), key=lambda c: (-c.created, c.id))

    def find_commits(self, *, thread: str | None = None, **metadata_equals: Any) -> list[Commit]:
        """Commits whose metadata has every given top-level key equal to the given value.

        E.g. ``find_commits(notebook_path="a.ipynb", kernel_id="k1")``; ``thread`` narrows
        to commits made on that thread. Newest first.
        """
        ids = self.index.find_commits(metadata_equals, thread)
        return [self._load_commit(c) for c in ids]

    # -- threads ---------------------------------------------------------------------------

    def threads(self) -> dict[str, str]:
        """Every thread name -> tip commit id."""
        out: dict[str, str] = {}
        for f in sorted(self.refs_dir.iterdir()):
            if f.name.startswith("."):
                continue
            if self.key is not None:
                got = self._open_ref(f.name)
                if got is not None:
                    out[got[0]] = got[1]
                continue
            name = urllib.parse.unquote(f.name)
            tip = self._read_ref(name)
            if tip is not None:
                out[name] = tip
        return out if self.key is None else dict(sorted(out.items()))

    def set_thread(self, name: str, commit_id: str, *, expected: str | None = UNSET) -> None:
        """Point thread ``name`` at ``commit_id`` (any ref); CAS against ``expected`` if given
        (None = the thread must not exist yet). Raises RefConflict on mismatch."""
        _check_thread_name(name)
        # shared store lock: gc (exclusive) must not collect the target while we point at it
        with FileLock(self.lock_path, shared=True, timeout=self.lock_timeout), \
                FileLock(self.refs_lock_path, timeout=self.lock_timeout):
            target = self.resolve(commit_id)
            tip = self._read_ref(name)
            if expected is not UNSET and tip != expected:
                raise RefConflict(f"thread {name!r} is at {tip or 'nothing'}, "
                                  f"expected {expected or 'nothing'}")
            self._write_ref(name, target)

    def delete_thread(self, name: str, *, expected: str | None = UNSET) -> None:
        """Remove thread ``name`` (its commits stay until gc). CAS against ``expected``."""
        _check_thread_name(name)
        with FileLock(self.refs_lock_path, timeout=self.lock_timeout):
            tip = self._read_ref(name)
            if tip is None:
                raise UnknownRef(f"no thread {name!r}")
            if expected is not UNSET and tip != expected:
                raise RefConflict(f"thread {name!r} is at {tip}, expected {expected}")
            fsutil.unlink_durable(self._ref_path(name))

    def _ref_path(self, name: str) -> Path:
        if self.key is not None:  # the thread's name is sealed inside, not the file's name
            return self.refs_dir / self.key.token("ref", name.encode())
        return self.refs_dir / urllib.parse.quote(name, safe="")

    def _open_ref(self, file_name: str) -> tuple[str, str] | None:
        """(thread, tip) of the sealed ref file ``file_name`` (an encrypted store's)."""
        assert self.key is not None
        try:
            data = (self.refs_dir / file_name).read_bytes()
        except FileNotFoundError:
            return None
        try:
            name, _, tip = self.key.open_named("ref", file_name, data).decode().partition("\n")
        except (CorruptObject, UnicodeDecodeError) as exc:
            raise CorruptObject(f"ref file {file_name} is damaged: {exc}") from None
        if not is_hex_id(tip) or self.key.token("ref", name.encode()) != file_name:
            raise CorruptObject(f"ref file {file_name} is damaged")
        return name, tip

    def _read_ref(self, name: str) -> str | None:
        if self.key is not None:
            got = self._open_ref(self._ref_path(name).name)
            return got[1] if got else None
        try:
            text = self._ref_path(name).read_text().strip()
        except FileNotFoundError:
            return None
        if not is_hex_id(text):
            raise CorruptObject(f"ref of thread {name!r} is damaged: {text[:80]!r}")
        return text

    def _write_ref(self, name: str, commit_id: str) -> None:
        path = self._ref_path(name)
        data = (commit_id + "\n").encode()
        if self.key is not None:
            data = self.key.seal_named("ref", path.name, f"{name}\n{commit_id}".encode())
        fsutil.atomic_write(path, data, tmp_dir=self.tmp_dir)

    # -- maintenance (see the module docs for checkout, check, gc and rebuild_index) ------

    def stats(self) -> dict[str, Any]:
        """Sizes and counts: commits, threads, packs, objects, logical vs stored bytes."""
        totals = self.index.object_totals()
        packs = self.index.packs()
        chunk = totals.get(CHUNK, (0, 0, 0))
        deltas = self.index.compression_totals().get(DELTA, (0, 0, 0))
        logical = 0
        for commit in self.log():
            logical += int(commit.stats.get("image_bytes", 0))
        pack_bytes = sum(s for s, _ in packs.values())
        return {
            "path": str(self.path),
            "chunker": self.config.chunker.algorithm,
            "commits": self.index.commit_count(),
            "threads": len(self.threads()),
            "packs": len(packs),
            "pack_bytes": pack_bytes,
            "chunks": chunk[0],
            "chunk_bytes_raw": chunk[2],
            "chunk_bytes_stored": chunk[1],
            "delta_chunks": deltas[0],
            "delta_bytes_stored": deltas[1],
            "trees": totals.get(TREE, (0, 0, 0))[0],
            "blobs": totals.get(BLOB, (0, 0, 0))[0],
            "logical_bytes": logical,
            "dedup_ratio": round(logical / pack_bytes, 3) if pack_bytes else None,
        }


def _open_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in kwargs.items() if k == "lock_timeout"}
    creds = kwargs.get("credentials") or kwargs.get("encrypt")
    return {**out, "credentials": creds} if creds is not None else out


def _valid_thread_name(name: str) -> bool:
    return (isinstance(name, str) and 0 < len(name) <= 200 and name.strip() == name
            and not any(ord(ch) < 32 or ord(ch) == 127 for ch in name))


def _check_thread_name(name: str) -> None:
    if not _valid_thread_name(name):
        raise InvalidRef(f"invalid thread name {name!r} (1-200 printable characters, "
                         "no leading/trailing space)")


__all__ = ["UNSET", "Dir", "Repository", "StoreConfig", "default_store_path"]
