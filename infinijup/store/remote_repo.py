"""The objects of a remote store, named and sealed: what push and pull (remote.py) read and
write, for both kinds of remote.

An *encrypted* remote (the default; keys.py made it)::

    config                         plain JSON: format, version, repository id
    keys/<slot id>                 key slots (keys.py)
    packs/<xx>/<name>              a local pack file, sealed as one object (crypto.py)
    commits/<xx>/<name>            a commit object (its canonical JSON), sealed
    manifests/<xx>/<name>          JSON list of the packs of a commit's tree, sealed
    refs/<name>                    JSON {"thread", "tip", "seq"}, sealed

Every ``<name>`` is the keyed BLAKE3 of the plaintext id (a pack's, a commit's, a thread's
name; crypto.py): only a key holder can map a name to content. ``seq`` counts a ref's moves;
a store remembers the highest it saw (remote.py), so an old ref put back is refused.

An *unencrypted* remote (pushed with ``--unencrypted``, or before encryption existed) has the
same directories without config and keys: plain ids as names, packs and commits as they are
locally, refs holding the tip id. Pulls verify it by hashes alone; a push to it must be asked
for (``Credentials.unencrypted``).
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .crypto import NotAuthentic, sealed_size
from .errors import (
    RemoteCorrupt,
    RemoteKeyRequired,
    RemoteNotEncrypted,
)
from .keys import Credentials, Unlocked, read_config, unlock
from .objects import is_hex_id
from .s3 import S3Bucket
from .sealed_transfer import fetch_sealed, send_sealed

_FORGED = "damaged, truncated, swapped or from another repository"


@dataclass(frozen=True)
class RemoteRef:
    """A thread's ref on the remote: its tip, the ETag to move it by compare-and-swap, and
    its sequence number (0 on an unencrypted remote)."""

    tip: str | None
    etag: str | None
    seq: int = 0


class RemoteRepo:
    """One opened remote (see the module docs). Use :func:`open_remote`."""

    def __init__(self, bucket: S3Bucket, unlocked: Unlocked | None, creds: Credentials
                 ) -> None:
        self.bucket = bucket
        self.url = bucket.url
        self.unlocked = unlocked
        self.key = unlocked.key if unlocked else None
        self.id = unlocked.repo_id if unlocked else None
        self.creds = creds

    @property
    def encrypted(self) -> bool:
        return self.key is not None

    def check_push_allowed(self) -> None:
        """Refuse to push to an unencrypted remote unless asked for explicitly."""
        if not self.encrypted and not self.creds.unencrypted:
            raise RemoteNotEncrypted(
                f"{self.url} is not encrypted: whoever can read the bucket (its owner, the "
                "provider, anyone holding a leaked access key) would read every snapshot "
                "pushed there, the kernels' memory included. Run `infinijup store key init "
                f"{self.url}` on an empty remote to encrypt it, or push in the clear with "
                "--unencrypted ($INFINIJUP_REMOTE_UNENCRYPTED=1)")

    # -- names ---------------------------------------------------------------------------
    def _name(self, kind: str, ident: str) -> str:
        n = ident if self.key is None else self.key.name(kind, bytes.fromhex(ident))
        return f"{kind}/{n[:2]}/{n}"

    def _ref_name(self, thread: str) -> str:
        if self.key is None:
            return "refs/" + urllib.parse.quote(thread, safe="")
        return "refs/" + self.key.name("refs", thread.encode())

    def _seal(self, name: str, data: bytes) -> bytes:
        return data if self.key is None else self.key.seal(name.split("/", 1)[0], name, data)

    def _open(self, name: str, blob: bytes, what: str) -> bytes:
        if self.key is None:
            return blob
        try:
            return self.key.open(name.split("/", 1)[0], name, blob)
        except NotAuthentic as exc:
            raise RemoteCorrupt(f"{what} on {self.url} does not authenticate ({exc}): "
                                f"{_FORGED}; refused") from None

    # -- packs ---------------------------------------------------------------------------
    def remote_size(self, local_size: int) -> int:
        """The size on the remote of a pack of ``local_size`` bytes."""
        return sealed_size(local_size) if self.encrypted else local_size

    def present_packs(self, packs: Iterable[str]) -> dict[str, int]:
        """Which of ``packs`` (local pack ids) the remote holds: id -> size there."""
        there = self.bucket.list("packs/")
        out = {}
        for p in packs:
            size = there.get(self._name("packs", p))
            if size is not None:
                out[p] = size
        return out

    def upload_pack(self, pack: str, path: Path) -> int:
        """Send the local pack file at ``path``; the bytes sent."""
        name = self._name("packs", pack)
        if self.key is None:
            self.bucket.upload(name, path)
            return path.stat().st_size
        return send_sealed(self.bucket, self.key, "packs", name, path)

    def download_pack(self, pack: str, dest: Path) -> None:
        """Fetch pack ``pack`` into ``dest`` as the local pack file (opened and authenticated
        when the remote is encrypted; the caller verifies its contents)."""
        name = self._name("packs", pack)
        if self.key is None:
            self.bucket.download(name, dest)
            return
        try:
            fetch_sealed(self.bucket, self.key, "packs", name, dest)
        except NotAuthentic as exc:
            raise RemoteCorrupt(f"pack {pack} on {self.url} (object {name}) does not "
                                f"authenticate ({exc}): {_FORGED}; nothing was restored"
                                ) from None

    # -- commits and manifests -------------------------------------------------------------
    def commits_present(self, ids: Iterable[str]) -> set[str]:
        """Which of the commit ``ids`` the remote holds."""
        there = self.bucket.list("commits/")
        return {c for c in ids if self._name("commits", c) in there}

    def put_commit(self, cid: str, body: bytes) -> None:
        name = self._name("commits", cid)
        self.bucket.put(name, self._seal(name, body))

    def get_commit(self, cid: str) -> bytes | None:
        """A commit's body as stored (the caller checks its hash), or None."""
        name = self._name("commits", cid)
        got = self.bucket.get(name)
        return None if got is None else self._open(name, got[0], f"commit {cid}")

    def put_manifest(self, cid: str, packs: list[str]) -> None:
        name = self._name("manifests", cid)
        self.bucket.put(name, self._seal(name, json.dumps(packs).encode()))

    def get_manifest(self, cid: str) -> list[str]:
        """The packs holding every object of ``cid``'s tree (RemoteCorrupt when the list is
        missing or damaged)."""
        name = self._name("manifests", cid)
        got = self.bucket.get(name)
        try:
            body = self._open(name, got[0], f"the pack list of commit {cid}") if got else None
            packs = json.loads(body) if body is not None else None
        except ValueError:
            packs = None
        if not isinstance(packs, list) or not all(isinstance(p, str) and is_hex_id(p)
                                                  for p in packs):
            raise RemoteCorrupt(f"the pack list of commit {cid} on {self.url} is missing "
                                "or damaged")
        return packs

    # -- refs ----------------------------------------------------------------------------------
    def read_ref(self, thread: str) -> RemoteRef:
        """The thread's ref; RemoteRef(None, None) when it does not exist."""
        name = self._ref_name(thread)
        got = self.bucket.get(name)
        if got is None:
            return RemoteRef(None, None)
        _named, tip, seq = self._parse_ref(name, got[0], thread)
        return RemoteRef(tip, got[1], seq)

    def _parse_ref(self, name: str, blob: bytes, thread: str | None
                   ) -> tuple[str | None, str, int]:
        """(thread, tip, seq) of a ref object, which must be ``thread``'s when given (the
        thread is None on an unencrypted remote)."""
        what = f"the ref of thread {thread!r}" if thread else f"ref {name}"
        body = self._open(name, blob, what)
        if self.key is None:
            text = body.decode(errors="replace").strip()
            if not is_hex_id(text):
                raise RemoteCorrupt(f"{what} on {self.url} is damaged")
            return thread, text, 0
        try:
            obj = json.loads(body)
            tip, seq, named = obj["tip"], obj["seq"], obj["thread"]
            ok = is_hex_id(tip) and isinstance(seq, int) and isinstance(named, str)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok or (thread is not None and named != thread):
            raise RemoteCorrupt(f"{what} on {self.url} is damaged")
        return named, tip, seq

    def write_ref(self, thread: str, tip: str, seq: int, etag: str | None) -> None:
        """Move (``etag``) or create (None) the ref by compare-and-swap; PreconditionFailed
        when it is not in that state."""
        name = self._ref_name(thread)
        if self.key is None:
            body = (tip + "\n").encode()
        else:
            body = json.dumps({"thread": thread, "tip": tip, "seq": seq}).encode()
        self.bucket.put(name, self._seal(name, body), if_match=etag, if_absent=etag is None)

    def threads(self) -> list[str]:
        """Every thread name on the remote."""
        names = sorted(self.bucket.list("refs/"))
        if self.key is None:
            return sorted(urllib.parse.unquote(k[len("refs/"):]) for k in names)
        out = []
        for name in names:
            got = self.bucket.get(name)
            if got is None:  # deleted meanwhile
                continue
            named, _tip, _seq = self._parse_ref(name, got[0], None)
            if named is None or self._ref_name(named) != name:
                raise RemoteCorrupt(f"ref {name} on {self.url} is damaged (swapped)")
            out.append(named)
        return sorted(out)


def open_remote(url: str, creds: Credentials | None = None) -> RemoteRepo:
    """Open the remote at ``url`` with ``creds`` (default: from the environment, keys.py).

    An encrypted remote needs a key that opens it (RemoteKeyRequired, RemoteWrongKey); a
    remote without encryption is refused when a key is given (it would be a downgrade)
    unless ``creds.unencrypted``."""
    creds = Credentials.from_env() if creds is None else creds
    bucket = S3Bucket(url)
    bucket.check_bucket()
    cfg = read_config(bucket)
    if cfg is None:
        if creds.has_key and not creds.unencrypted:
            raise RemoteNotEncrypted(
                f"{bucket.url} is not an encrypted remote (no config: it is empty, or holds "
                "a store pushed without encryption), but a key was given. `infinijup store "
                f"key init {bucket.url}` makes an empty remote encrypted; --unencrypted "
                "uses it as it is")
        return RemoteRepo(bucket, None, creds)
    if not creds.has_key:
        raise RemoteKeyRequired(
            f"{bucket.url} is encrypted: give its key (--password-file, --key-file, "
            "$INFINIJUP_STORE_PASSWORD_FILE or $INFINIJUP_STORE_KEY_FILE). Without a key "
            "its data cannot be read")
    return RemoteRepo(bucket, unlock(bucket, cfg, creds), creds)


__all__ = ["RemoteRef", "RemoteRepo", "open_remote"]
