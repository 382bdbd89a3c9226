"""Encryption at rest of a local store (format 3): its keys, keyed ids and sealed objects.

``Repository.init(encrypt=...)`` makes such a store and ``Repository.open`` unlocks it; the
store's modules (writer, packs, reader, checkout, index, gc, check, rebuild) use the
``StoreKey`` held as ``repo.key`` (None in a plain store). docs/store.md, "The local store",
describes the format and what a reader of the disk still learns. What is here:

* **Keys**, as a remote's (keys.py): one master key wrapped by key slots (a password through
  Argon2id, or a key file) in ``<store>/keys/<slot id>``, and ``<store>/encryption`` (JSON,
  nothing secret: the scheme and the store's random 16-byte id). ``open_keys`` unlocks them
  once per process; a wrong password or key file, a removed slot or no key at all is
  :class:`~infinijup.store.errors.StoreWrongKey`.
* **Keyed ids**: an object's id is ``BLAKE3-keyed(id key, plaintext)``, so nobody without the
  key can test the store for a known file by its plain BLAKE3 hash, while the same content
  still gets the same id within the store (dedup keeps working).
* **Tokens and sealed files**: ``token`` (keyed, for ref file names and the index's
  threads and metadata) and ``seal_named`` / ``open_named`` (commit files and refs, bound
  to their names).
* **Sealed objects**: each stored payload (after compression) is sealed on its own with
  AES-256-GCM under the *object key*: ``nonce (12 random bytes) || ciphertext || tag (16)``,
  28 bytes more per object; the object's keyed id, type and compression are its associated
  data, so a payload moved under another id or flipped is refused, and a repack can copy a
  sealed payload verbatim (its position is not bound). Pack headers are sealed the same way
  with their own associated data. Random nonces under one key: the chance of a repeated
  nonce stays below 2^-32 up to 2^32 objects (128 TiB of 32 KiB chunks).

The id and object keys are derived from the master key with BLAKE3's key derivation in
contexts of their own (not a remote's), so the same master key never serves two jobs.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from . import fsutil, keys
from .crypto import KEY_BYTES, REPO_ID_BYTES, RepoKey, random_key
from .errors import CorruptObject, RemoteWrongKey, StoreWrongKey, UnsupportedFormat
from .s3 import PreconditionFailed

ENCRYPTION_FILE = "encryption"
KEYS_DIR = "keys"
SCHEME = "aes-256-gcm+blake3-keyed"
NONCE = 12
TAG = 16
OVERHEAD = NONCE + TAG  # sealed bytes more than the plaintext, per object (packs.SEALED)
_OBJECT_AD = b"IJLO"  # + type, compression, keyed id
_HEADER_AD = b"IJLH"  # + pack format version
_CONTEXT = "infinijup local store 2026-11 {} key"


class StoreKey:
    """The keys of one encrypted local store, derived from its master key."""

    def __init__(self, master: bytes, store_id: bytes) -> None:
        if len(master) != KEY_BYTES or len(store_id) != REPO_ID_BYTES:
            raise ValueError("a master key is 32 bytes and a store id 16")
        self.store_id = store_id
        self._id_key = blake3.blake3(master, derive_key_context=_CONTEXT.format("id")).digest()
        obj = blake3.blake3(master, derive_key_context=_CONTEXT.format("object")).digest()
        self._aead = AESGCM(obj)
        self._token_key = blake3.blake3(master,
                                        derive_key_context=_CONTEXT.format("token")).digest()

    # -- ids ---------------------------------------------------------------------------------
    def object_id(self, data: bytes | memoryview) -> bytes:
        """The keyed id (32 bytes) of an object whose plaintext is ``data``."""
        return blake3.blake3(data, key=self._id_key).digest()

    def hasher(self) -> blake3.blake3:
        """A keyed BLAKE3 hasher for content fed in parts (its digest is ``object_id``)."""
        return blake3.blake3(key=self._id_key)

    # -- objects -----------------------------------------------------------------------------
    def seal(self, oid: bytes, typ: int, compression: int, payload: bytes | memoryview
             ) -> bytes:
        """``payload`` (stored form, after compression) sealed as object ``oid``."""
        nonce = os.urandom(NONCE)
        return nonce + self._aead.encrypt(nonce, bytes(payload), _object_ad(oid, typ,
                                                                           compression))

    def open(self, oid: bytes, typ: int, compression: int, sealed: bytes | memoryview
             ) -> bytes:
        """The stored payload of object ``oid``; CorruptObject if it does not open (damaged,
        truncated, or another object's)."""
        if len(sealed) < OVERHEAD:
            raise CorruptObject(f"object {oid.hex()}: sealed payload truncated")
        view = memoryview(sealed)
        try:
            return self._aead.decrypt(view[:NONCE], view[NONCE:],
                                      _object_ad(oid, typ, compression))
        except InvalidTag:
            raise CorruptObject(f"object {oid.hex()}: sealed payload does not authenticate "
                                "(damaged, or not this object's)") from None

    def open_run(self, typ: int, sealed: memoryview, items: list[tuple[bytes, int, int, int]],
                 out: memoryview) -> tuple[int, list[tuple[bytes, int, int, int]]]:
        """Open the objects of ``typ`` lying back to back in ``sealed`` (``items``: id, sealed
        length, raw length, compression, in order) into ``out``, one after the other (for
        checkout: one call per run). Returns the bytes written and the items with their
        payloads' lengths; CorruptObject names the first object that does not open."""
        decrypt_into = self._aead.decrypt_into
        ads = {c: _OBJECT_AD + bytes([typ, c]) for c in {it[3] for it in items}}
        opened = []
        pos = at = 0
        for oid, length, raw, comp in items:
            n = length - OVERHEAD
            end = pos + length
            try:
                if n < 0:
                    raise InvalidTag
                decrypt_into(sealed[pos:pos + NONCE], sealed[pos + NONCE:end], ads[comp] + oid,
                             out[at:at + n])
            except InvalidTag:
                raise CorruptObject(f"object {oid.hex()}: sealed payload does not "
                                    "authenticate (damaged, or not this object's)") from None
            opened.append((oid, n, raw, comp))
            pos, at = end, at + n
        return at, opened

    def seal_header(self, header: bytes, version: int) -> bytes:
        """A pack header sealed (the list of ids and sizes it holds is hidden too)."""
        nonce = os.urandom(NONCE)
        return nonce + self._aead.encrypt(nonce, header, _HEADER_AD + bytes([version]))

    def open_header(self, sealed: bytes, version: int, name: str = "?") -> bytes:
        """The plaintext of a sealed pack header; CorruptObject if it does not open."""
        if len(sealed) < OVERHEAD:
            raise CorruptObject(f"pack {name}: sealed header truncated")
        try:
            return self._aead.decrypt(sealed[:NONCE], sealed[NONCE:],
                                      _HEADER_AD + bytes([version]))
        except InvalidTag:
            raise CorruptObject(f"pack {name}: sealed header does not authenticate") from None


    # -- commits, refs, index entries -------------------------------------------------------
    def token(self, kind: str, value: bytes) -> str:
        """A keyed token (64 hex digits) standing for ``value`` where a name or an indexed
        value would be plaintext (ref file names, the index's threads and metadata)."""
        return blake3.blake3(kind.encode() + b"\0" + value, key=self._token_key).hexdigest()

    def seal_named(self, kind: str, name: str, data: bytes) -> bytes:
        """``data`` sealed as the ``kind`` file ``name`` (a commit, a ref)."""
        nonce = os.urandom(NONCE)
        return nonce + self._aead.encrypt(nonce, data, _named_ad(kind, name))

    def open_named(self, kind: str, name: str, sealed: bytes) -> bytes:
        """The plaintext of a ``seal_named`` file; CorruptObject if it does not open."""
        if len(sealed) < OVERHEAD:
            raise CorruptObject(f"{kind} {name}: sealed file truncated")
        try:
            return self._aead.decrypt(sealed[:NONCE], sealed[NONCE:], _named_ad(kind, name))
        except InvalidTag:
            raise CorruptObject(f"{kind} {name}: sealed file does not authenticate "
                                "(damaged, or not this one)") from None


def _named_ad(kind: str, name: str) -> bytes:
    return b"IJLN" + kind.encode() + b"\0" + name.encode()


def _object_ad(oid: bytes, typ: int, compression: int) -> bytes:
    return _OBJECT_AD + bytes([typ, compression]) + oid


# -- key slots in the store's directory ------------------------------------------------------

class _SlotDir:
    """The store's ``keys/`` directory, read and written the way keys.py uses a bucket:
    ``get``, ``put`` (never over an existing name), ``list``, ``delete``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)

    def _path(self, name: str) -> Path:
        if not name.startswith(KEYS_DIR + "/") or "/" in name[len(KEYS_DIR) + 1:]:
            raise ValueError(f"not a key slot name: {name!r}")
        return self.root / name

    def get(self, name: str) -> tuple[bytes, str] | None:
        try:
            return self._path(name).read_bytes(), ""
        except FileNotFoundError:
            return None

    def put(self, name: str, data: bytes, *, if_absent: bool = True) -> None:
        path = self._path(name)
        fsutil.make_private_dir(path.parent)
        tmp = fsutil.temp_name(path.parent, ".slot")
        fd = fsutil.open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails rather than replace: a slot is never overwritten
        except FileExistsError:
            raise PreconditionFailed(name) from None
        finally:
            tmp.unlink()
        fsutil.fsync_dir(path.parent)

    def list(self, prefix: str) -> dict[str, int]:
        folder = self.root / KEYS_DIR
        if not folder.is_dir():
            return {}
        out = {f"{KEYS_DIR}/{p.name}": p.stat().st_size for p in folder.iterdir()
               if p.is_file() and not p.name.startswith(".")}
        return {n: s for n, s in out.items() if n.startswith(prefix)}

    def delete(self, name: str) -> None:
        fsutil.unlink_durable(self._path(name))


@dataclass(frozen=True)
class OpenedKeys:
    """An unlocked store: its keys, and the slot that opened them."""

    key: StoreKey = field(repr=False)
    master: bytes = field(repr=False)
    store_id: str
    slot: str


def is_encrypted(root: str | os.PathLike[str]) -> bool:
    """Whether the store at ``root`` has keys (an ``encryption`` file)."""
    return (Path(root) / ENCRYPTION_FILE).is_file()


def init_keys(root: str | os.PathLike[str], creds: keys.Credentials, *, label: str = "",
              kdf: keys.KdfParams | None = None) -> OpenedKeys:
    """Give the store directory ``root`` a new master key and its first slot (a password,
    else a key file, created when absent); refused if it has keys already."""
    root = Path(root)
    if not creds.has_key:
        raise StoreWrongKey("an encrypted store needs a password ($INFINIJUP_STORE_PASSWORD_"
                            "FILE) or a key file ($INFINIJUP_STORE_KEY_FILE)")
    if is_encrypted(root) or (root / KEYS_DIR).exists():
        raise UnsupportedFormat(f"{root} has keys already (add one with `key add`)")
    fsutil.make_private_dir(root)
    master, store_id = random_key(), secrets.token_bytes(REPO_ID_BYTES)
    slot = keys.add_slot(_SlotDir(root), master, store_id, creds, label=label, kdf=kdf)
    desc = {"encryption": SCHEME, "id": store_id.hex(), "version": 1}
    fsutil.atomic_write(root / ENCRYPTION_FILE, json.dumps(desc, sort_keys=True).encode())
    return OpenedKeys(StoreKey(master, store_id), master, store_id.hex(), slot)


def _store_id(root: Path) -> str:
    try:
        desc = json.loads((root / ENCRYPTION_FILE).read_bytes())
        ok = desc.get("encryption") == SCHEME and desc.get("version") == 1
        bytes.fromhex(desc["id"])
        ok = ok and len(desc["id"]) == 2 * REPO_ID_BYTES
    except FileNotFoundError:
        raise StoreWrongKey(f"{root} is not an encrypted store") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise UnsupportedFormat(f"{root / ENCRYPTION_FILE} is damaged or of an unknown "
                                "scheme")
    return desc["id"]


def open_keys(root: str | os.PathLike[str], creds: keys.Credentials) -> OpenedKeys:
    """Unlock the store at ``root`` with ``creds`` (StoreWrongKey when no slot opens)."""
    root = Path(root)
    store_id = _store_id(root)
    if not creds.has_key:
        raise StoreWrongKey(f"{root} is encrypted: give its password "
                            f"(${keys.PASSWORD_FILE_ENV}) or key file (${keys.KEY_FILE_ENV})")
    try:
        got = keys.unlock(_SlotDir(root), {"id": store_id}, creds)
    except RemoteWrongKey as exc:
        raise StoreWrongKey(str(exc)) from None
    return OpenedKeys(StoreKey(got.master, bytes.fromhex(store_id)), got.master, store_id,
                      got.slot)


def _as_repo(opened: OpenedKeys) -> keys.Unlocked:
    return keys.Unlocked(RepoKey(opened.master, bytes.fromhex(opened.store_id)),
                         opened.master, opened.store_id, opened.slot)


def add_key(root: str | os.PathLike[str], opened: OpenedKeys, creds: keys.Credentials, *,
            label: str = "", kdf: keys.KdfParams | None = None) -> str:
    """Another slot for the same master key; its id."""
    return keys.add_slot(_SlotDir(Path(root)), opened.master, bytes.fromhex(opened.store_id),
                         creds, label=label, kdf=kdf)


def list_keys(root: str | os.PathLike[str]) -> list[keys.Slot]:
    """The store's key slots, oldest first."""
    return keys.list_slots(_SlotDir(Path(root)))


def remove_key(root: str | os.PathLike[str], slot_id: str, opened: OpenedKeys) -> None:
    """Remove a slot (never the one that opened the store, never the last)."""
    keys.remove_slot(_SlotDir(Path(root)), slot_id, opened.slot)


def change_password(root: str | os.PathLike[str], opened: OpenedKeys,
                    new: keys.Credentials, *, label: str = "",
                    kdf: keys.KdfParams | None = None) -> str:
    """Replace the slot that opened the store by one for ``new``; the new slot's id."""
    return keys.change_password(_SlotDir(Path(root)), _as_repo(opened), new, label=label,
                                kdf=kdf)


__all__ = ["ENCRYPTION_FILE", "KEYS_DIR", "OVERHEAD", "OpenedKeys", "SCHEME", "StoreKey",
           "add_key", "change_password", "init_keys", "is_encrypted", "list_keys",
           "open_keys", "remove_key"]
