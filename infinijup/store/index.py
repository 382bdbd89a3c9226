"""The SQLite index: where each object lives, and what each commit says.

The index is a cache. Everything in it is derived from pack headers and commit files and can
be rebuilt (``rebuild.rebuild_index``); the thread refs live in ``refs/`` files, not
here. It runs in WAL mode so readers never block the one writer, with a busy timeout so
concurrent processes queue rather than fail.

Tables: ``packs`` (one row per pack file), ``objects`` (object id -> pack, offset, lengths,
type, compression), ``commits`` (id, created, thread, tree, encoded commit),
``commit_parents`` and ``commit_meta`` (top-level metadata key -> canonical JSON value, so
snapshots can be found by notebook path, kernel id, ...), ``layouts`` (a large blob's id ->
its chunks' lengths, zstd-compressed little-endian uint32: where each chunk starts, known
without looking every chunk up; written by the writer that stored the blob, none in an
encrypted store).

In an encrypted store (``key``, a local_crypto.StoreKey) the index holds nothing in the
clear that the files do not: ``commits.body`` is the commit's sealed file, ``commits.thread``
and ``commit_meta``'s keys and values are keyed tokens (``find_commits`` looks the tokens of
what it is asked for up), and ids are keyed.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from . import fsutil
from .errors import IndexCorrupt
from .objects import ID_BYTES, Commit, canonical_json
from .packs import DELTA, PackEntry

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS packs (
    pid INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    size INTEGER NOT NULL,
    count INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS objects (
    id BLOB PRIMARY KEY,
    pid INTEGER NOT NULL,
    offset INTEGER NOT NULL,
    length INTEGER NOT NULL,
    raw_length INTEGER NOT NULL,
    type INTEGER NOT NULL,
    compression INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS objects_pid ON objects (pid);
CREATE TABLE IF NOT EXISTS commits (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    thread TEXT NOT NULL,
    tree TEXT NOT NULL,
    body BLOB NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS commits_created ON commits (created);
CREATE TABLE IF NOT EXISTS commit_parents (
    child TEXT NOT NULL, parent TEXT NOT NULL, pos INTEGER NOT NULL,
    PRIMARY KEY (child, pos)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS commit_meta (
    commit_id TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL,
    PRIMARY KEY (commit_id, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS commit_meta_kv ON commit_meta (key, value);
CREATE TABLE IF NOT EXISTS layouts (id BLOB PRIMARY KEY, lengths BLOB NOT NULL) WITHOUT ROWID;
"""


class Location(NamedTuple):
    """Where an object is stored (a named tuple: checkout builds one per chunk)."""

    pack: str
    offset: int
    length: int
    raw_length: int
    type: int
    compression: int


class Index:
    """A thread-safe handle on the SQLite index of one store."""

    def __init__(self, path: Path, key: Any = None) -> None:
        self.path = path
        self._key = key
        self._lock = threading.RLock()
        if not path.exists():
            os.close(fsutil.open_private(path, os.O_WRONLY | os.O_CREAT))
        try:
            self._db = sqlite3.connect(
                str(path), timeout=60.0, isolation_level=None, check_same_thread=False
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            # ingest inserts thousands of random (hash) keys per transaction: keep the
            # B-trees in memory and checkpoint the WAL less often (fewer rewrites of pages)
            self._db.execute("PRAGMA cache_size=-65536")
            self._db.execute("PRAGMA wal_autocheckpoint=16384")
            # A long-lived server keeps the store open: without a limit the WAL file only
            # ever grows (98 MiB after 200 snapshots in the soak).
            self._db.execute("PRAGMA journal_size_limit=16777216")
            self._db.executescript(_SCHEMA)
            self._bulk = _has_json(self._db)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if row is None:
                self._db.execute(
                    "INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),)
                )
            elif row[0] != str(SCHEMA_VERSION):
                raise IndexCorrupt(
                    f"index schema {row[0]} is not {SCHEMA_VERSION}; run rebuild-index"
                )
        except sqlite3.DatabaseError as exc:
            raise IndexCorrupt(
                f"index {path} is unreadable ({exc}); run `infinijup store rebuild-index`"
            ) from exc

    def truncate_journal(self) -> None:
        """Fold the WAL into the database and shrink it (after gc removed many rows)."""
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._db.close()

    # -- helpers ---------------------------------------------------------------------------

    def _query(self, sql: str, params: Iterable[Any] | dict[str, Any] = ()
               ) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._db.execute(
                    sql, params if isinstance(params, dict) else tuple(params)).fetchall()
            except sqlite3.DatabaseError as exc:
                raise IndexCorrupt(f"index query failed ({exc}); run rebuild-index") from exc

    def _write(self, statements: list[_Stmt]) -> None:
        """Run (sql, params, many) statements (or callables taking the connection) in one
        IMMEDIATE transaction."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    for stmt in statements:
                        if callable(stmt):
                            stmt(self._db)
                            continue
                        sql, params, many = stmt
                        if many:
                            self._db.executemany(sql, params)
                        else:
                            self._db.execute(sql, tuple(params))
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            except sqlite3.DatabaseError as exc:
                raise IndexCorrupt(f"index update failed ({exc}); run rebuild-index") from exc

    # -- objects ---------------------------------------------------------------------------

    def add_pack(self, name: str, size: int, entries: list[PackEntry]) -> None:
        """Record a pack and its objects; objects already indexed keep their location."""
        self.add_packs([(name, size, entries)])

    def add_pack_rows(self, packs: list[tuple[str, int, int, _RowsFor]]) -> None:
        """Record packs given as (name, size, object count, rows) where ``rows(pid)`` gives
        the pack's ``objects`` rows (id, pid, offset, length, raw length, type,
        compression), e.g. ``PackWriter.index_rows``. One transaction; the rows of all the
        packs are inserted sorted by id (one pass over the B-tree instead of random
        jumps); objects already indexed keep their location."""

        def insert(db: sqlite3.Connection) -> None:
            rows: list[tuple[bytes, int, int, int, int, int, int]] = []
            for name, size, count, rows_for in packs:
                db.execute("INSERT OR IGNORE INTO packs (name, size, count) VALUES (?,?,?)",
                           (name, size, count))
                pid = db.execute("SELECT pid FROM packs WHERE name=?", (name,)).fetchone()[0]
                rows += rows_for(pid)
            rows.sort(key=_first)
            if self._bulk:  # one statement: the GIL is released once, not once per row
                for i in range(0, len(rows), _BULK):
                    part = rows[i : i + _BULK]
                    db.execute(_BULK_INSERT, {"ids": b"".join([r[0] for r in part]),
                                              "rows": json.dumps([r[1:] for r in part])})
            else:
                db.executemany("INSERT OR IGNORE INTO objects VALUES (?,?,?,?,?,?,?)", rows)

        self._write([insert])

    def add_packs(self, packs: list[tuple[str, int, list[PackEntry]]], *,
                  replace: bool = False) -> None:
        """Record several packs in one transaction. ``replace`` moves existing objects."""
        self._write(_pack_statements([(n, s, len(e), e) for n, s, e in packs], replace))

    def remove_packs(self, names: Iterable[str]) -> None:
        """Forget packs and every object located in them (and the layouts of blobs gone)."""
        rows = [(n,) for n in names]
        self._write([
            ("DELETE FROM objects WHERE pid IN (SELECT pid FROM packs WHERE name=?)", rows, True),
            ("DELETE FROM packs WHERE name=?", rows, True),
            ("DELETE FROM layouts WHERE NOT EXISTS "
             "(SELECT 1 FROM objects o WHERE o.id = layouts.id)", (), False),
        ])

    def add_layouts(self, rows: list[tuple[bytes, bytes]]) -> None:
        """Record blobs' layouts, (blob id, compressed lengths); a known one is kept."""
        if rows:
            self._write([("INSERT OR IGNORE INTO layouts VALUES (?, ?)", rows, True)])

    def layout(self, blob_id: bytes) -> bytes | None:
        """A blob's recorded layout (compressed lengths), or None."""
        rows = self._query("SELECT lengths FROM layouts WHERE id=?", (blob_id,))
        return rows[0][0] if rows else None

    def known(self, ids: list[bytes]) -> set[bytes]:
        """The subset of ``ids`` that the index holds."""
        found: set[bytes] = set()
        blob = b"".join(ids)
        if self._bulk and len(blob) == ID_BYTES * len(ids):
            # ids passed as one blob, answer in one row (one step, one GIL release)
            for i in range(0, len(ids), _BULK):
                part = ids[i : i + _BULK]
                rows = self._query(_BULK_KNOWN, {
                    "n": len(part), "ids": blob[i * ID_BYTES : (i + len(part)) * ID_BYTES]})
                found.update(part[k] for k in json.loads(rows[0][0]))
            return found
        for i in range(0, len(ids), 500):
            part = ids[i : i + 500]
            marks = ",".join("?" * len(part))
            found.update(r[0] for r in self._query(
                f"SELECT id FROM objects WHERE id IN ({marks})", part))
        return found

    def packs_holding(self, ids: list[bytes]) -> tuple[set[str], int]:
        """The packs that hold any of ``ids`` (distinct ids), and how many of them are
        indexed: one row per statement, no row per object (store_pages.py opens a restore's
        packs with it, beside the restore)."""
        names: set[str] = set()
        found = 0
        blob = b"".join(ids)
        if self._bulk and len(blob) == ID_BYTES * len(ids):
            for i in range(0, len(ids), _BULK):
                part = ids[i : i + _BULK]
                (packs, count), = self._query(_BULK_PACKS, {
                    "n": len(part), "ids": blob[i * ID_BYTES : (i + len(part)) * ID_BYTES]})
                names.update(json.loads(packs))
                found += count
            return names, found
        for i in range(0, len(ids), 500):
            part = ids[i : i + 500]
            marks = ",".join("?" * len(part))
            rows = self._query("SELECT p.name FROM objects o JOIN packs p ON p.pid = o.pid "
                               f"WHERE o.id IN ({marks})", part)
            names.update(r[0] for r in rows)
            found += len(rows)
        return names, found

    def lookup(self, oid: bytes) -> Location | None:
        """Where object ``oid`` is stored, or None."""
        rows = self._query(
            "SELECT p.name, o.offset, o.length, o.raw_length, o.type, o.compression "
            "FROM objects o JOIN packs p ON p.pid = o.pid WHERE o.id = ?", (oid,))
        return Location(*rows[0]) if rows else None

    def lookup_many(self, ids: list[bytes]) -> dict[bytes, Location]:
        """Locations of those ``ids`` that are indexed."""
        out: dict[bytes, Location] = {}
        uniq = list(dict.fromkeys(ids))
        if self._bulk and sum(map(len, uniq)) == ID_BYTES * len(uniq):
            # as in known(): one statement, one result row per call
            for i in range(0, len(uniq), _BULK):
                part = uniq[i : i + _BULK]
                rows = self._query(_BULK_LOOKUP, {"n": len(part), "ids": b"".join(part)})
                for k, *loc in json.loads(rows[0][0]):
                    out[part[k]] = Location(*loc)
            return out
        for i in range(0, len(ids), 500):
            part = list(dict.fromkeys(ids[i : i + 500]))
            marks = ",".join("?" * len(part))
            for row in self._query(
                "SELECT o.id, p.name, o.offset, o.length, o.raw_length, o.type, o.compression "
                f"FROM objects o JOIN packs p ON p.pid = o.pid WHERE o.id IN ({marks})", part):
                out[row[0]] = Location(*row[1:])
        return out

    def packs(self) -> dict[str, tuple[int, int]]:
        """Every indexed pack: name -> (size, object count)."""
        return {n: (s, c) for n, s, c in self._query("SELECT name, size, count FROM packs")}

    def iter_objects(self) -> Iterator[tuple[bytes, Location]]:
        """Every indexed object with its location, grouped by pack, in file order."""
        rows = self._query(
            "SELECT o.id, p.name, o.offset, o.length, o.raw_length, o.type, o.compression "
            "FROM objects o JOIN packs p ON p.pid = o.pid ORDER BY p.name, o.offset")
        for row in rows:
            yield row[0], Location(*row[1:])

    def compression_totals(self) -> dict[int, tuple[int, int, int]]:
        """Per compression (raw, zstd, delta): (count, stored bytes, raw bytes)."""
        return {t: (c, s, r) for t, c, s, r in self._query(
            "SELECT compression, COUNT(*), SUM(length), SUM(raw_length) FROM objects "
            "GROUP BY compression")}

    def object_totals(self) -> dict[int, tuple[int, int, int]]:
        """Per object type: (count, stored bytes, raw bytes)."""
        return {t: (c, s, r) for t, c, s, r in self._query(
            "SELECT type, COUNT(*), SUM(length), SUM(raw_length) FROM objects GROUP BY type")}

    # -- commits ---------------------------------------------------------------------------

    def add_commits(self, commits: list[tuple[Commit, bytes]]) -> None:
        """Index commits (with their encoded bodies)."""
        self._write(_commit_statements(commits, self._key))

    def remove_commits(self, ids: Iterable[str]) -> None:
        """Forget commits."""
        rows = [(i,) for i in ids]
        self._write([
            ("DELETE FROM commits WHERE id=?", rows, True),
            ("DELETE FROM commit_parents WHERE child=?", rows, True),
            ("DELETE FROM commit_meta WHERE commit_id=?", rows, True),
        ])

    def has_commit(self, commit_id: str) -> bool:
        """Whether the commit is indexed."""
        return bool(self._query("SELECT 1 FROM commits WHERE id=?", (commit_id,)))

    def commits_with_prefix(self, prefix: str, limit: int = 2) -> list[str]:
        """Up to ``limit`` commit ids starting with ``prefix`` (lower-case hex)."""
        upper = prefix + "g"  # 'g' sorts after every hex digit
        return [r[0] for r in self._query(
            "SELECT id FROM commits WHERE id >= ? AND id < ? ORDER BY id LIMIT ?",
            (prefix, upper, limit))]

    def commit_ids(self) -> list[str]:
        """Every indexed commit id, newest first."""
        return [r[0] for r in self._query("SELECT id FROM commits ORDER BY created DESC, id")]

    def commit_parents(self) -> dict[str, list[str]]:
        """child -> parents, for every indexed commit."""
        out: dict[str, list[str]] = {}
        for child, parent in self._query(
                "SELECT child, parent FROM commit_parents ORDER BY child, pos"):
            out.setdefault(child, []).append(parent)
        return out

    def find_commits(self, metadata: dict[str, Any], thread: str | None = None) -> list[str]:
        """Ids of commits whose top-level metadata equals every given key/value, newest first."""
        sql = "SELECT c.id FROM commits c"
        params: list[Any] = []
        for i, (k, v) in enumerate(sorted(metadata.items())):
            sql += (f" JOIN commit_meta m{i} ON m{i}.commit_id = c.id"
                    f" AND m{i}.key = ? AND m{i}.value = ?")
            params += _meta_row(self._key, k, v)
        if thread is not None:
            sql += " WHERE c.thread = ?"
            params.append(_thread_value(self._key, thread))
        return [r[0] for r in self._query(sql + " ORDER BY c.created DESC, c.id", params)]

    def commit_count(self) -> int:
        """Number of indexed commits."""
        return int(self._query("SELECT COUNT(*) FROM commits")[0][0])

    def replace_all(self, packs: list[tuple[str, int, list[PackEntry]]],
                    commits: list[tuple[Commit, bytes]]) -> None:
        """Atomically replace the whole content (used by rebuild-index).

        Where packs hold an object twice (two writers stored it at once), the index names a
        copy stored whole before a page-delta copy, so delta sources stay whole."""
        clear = [(f"DELETE FROM {t}", (), False) for t in
                 ("objects", "packs", "commits", "commit_parents", "commit_meta", "layouts")]
        whole = [(n, s, len(e), [x for x in e if x.compression != DELTA]) for n, s, e in packs]
        deltas = [(n, s, len(e), [x for x in e if x.compression == DELTA]) for n, s, e in packs]
        self._write(clear + _pack_statements(whole, False)
                    + _pack_statements([p for p in deltas if p[3]], False)
                    + _commit_statements(commits, self._key))


_Stmt = tuple[str, Any, bool] | Callable[[sqlite3.Connection], None]
#: pid -> rows of the ``objects`` table for one pack
_RowsFor = Callable[[int], Iterable[tuple[bytes, int, int, int, int, int, int]]]


# Bulk statements (SQLite's JSON functions, built in since 3.38): many ids in one blob, many
# rows in one JSON text, so a statement is stepped once for thousands of objects. Python's
# sqlite3 releases the GIL around every step: one step per row costs a GIL hand-off per
# object, which is what limits ingest and checkout on many cores.
_BULK = 1 << 16
_SEQ = "WITH RECURSIVE seq(k) AS (SELECT 0 UNION ALL SELECT k + 1 FROM seq WHERE k + 1 < :n) "
_BULK_KNOWN = (_SEQ + "SELECT json_group_array(k) FROM seq "
               "WHERE EXISTS (SELECT 1 FROM objects WHERE id = substr(:ids, k * 32 + 1, 32))")
_BULK_LOOKUP = (_SEQ + "SELECT json_group_array(json_array(k, p.name, o.offset, o.length, "
                "o.raw_length, o.type, o.compression)) "
                "FROM seq JOIN objects o ON o.id = substr(:ids, k * 32 + 1, 32) "
                "JOIN packs p ON p.pid = o.pid")
_BULK_PACKS = (_SEQ + "SELECT json_group_array(DISTINCT p.name), COUNT(*) "
               "FROM seq JOIN objects o ON o.id = substr(:ids, k * 32 + 1, 32) "
               "JOIN packs p ON p.pid = o.pid")
_BULK_INSERT = ("INSERT OR IGNORE INTO objects SELECT substr(:ids, j.key * 32 + 1, 32), "
                + ", ".join(f"json_extract(j.value, '$[{i}]')" for i in range(6))
                + " FROM json_each(:rows) AS j")


def _has_json(db: sqlite3.Connection) -> bool:
    try:
        db.execute("SELECT json_array(1), json_group_array(1)").fetchone()
    except sqlite3.OperationalError:
        return False
    return True


def _first(row: tuple[Any, ...]) -> Any:
    return row[0]


def _pack_statements(packs: list[tuple[str, int, int, list[PackEntry]]], replace: bool
                     ) -> list[_Stmt]:
    """Statements adding packs given as (name, size, object count, entries to index)."""
    def rows_for(entries: list[PackEntry]) -> _RowsFor:
        return lambda pid: ((e.id, pid, e.offset, e.length, e.raw_length, e.type,
                             e.compression) for e in entries)

    return [_pack_inserter(name, size, count, rows_for(entries), replace)
            for name, size, count, entries in packs]


def _pack_inserter(name: str, size: int, count: int, rows: _RowsFor, replace: bool
                   ) -> Callable[[sqlite3.Connection], None]:
    verb = "INSERT OR REPLACE" if replace else "INSERT OR IGNORE"

    def insert(db: sqlite3.Connection) -> None:
        db.execute("INSERT OR IGNORE INTO packs (name, size, count) VALUES (?,?,?)",
                   (name, size, count))
        pid = db.execute("SELECT pid FROM packs WHERE name=?", (name,)).fetchone()[0]
        db.executemany(f"{verb} INTO objects VALUES (?,?,?,?,?,?,?)", rows(pid))

    return insert


def _thread_value(key: Any, thread: str) -> str:
    return thread if key is None else key.token("index thread", thread.encode())


def _meta_row(key: Any, k: str, v: Any) -> list[str]:
    """(key, value) of a ``commit_meta`` row: canonical JSON, or keyed tokens."""
    value = canonical_json(v).decode()
    if key is None:
        return [k, value]
    return [key.token("index meta key", k.encode()),
            key.token("index meta value", k.encode() + b"\0" + value.encode())]


def _commit_statements(commits: list[tuple[Commit, bytes]], key: Any = None) -> list[_Stmt]:
    stmts: list[_Stmt] = []
    for c, body in commits:
        stmts.append(("INSERT OR IGNORE INTO commits VALUES (?,?,?,?,?)",
                      (c.id, c.created, _thread_value(key, c.thread), c.tree, body), False))
        stmts.append(("INSERT OR IGNORE INTO commit_parents VALUES (?,?,?)",
                      [(c.id, p, i) for i, p in enumerate(c.parents)], True))
        stmts.append(("INSERT OR IGNORE INTO commit_meta VALUES (?,?,?)",
                      [(c.id, *_meta_row(key, k, v)) for k, v in c.metadata.items()],
                      True))
    return stmts
