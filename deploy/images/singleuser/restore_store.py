"""Bring a user's snapshot store back from the remote where their home has none.

Run by start.sh as the notebook user before the Jupyter server starts, when INFINIJUP_REMOTE
(``s3://bucket/prefix``) is set. The store normally lives on the user's home volume and
follows the user to whichever node their next server lands on; this covers a home that comes
up without it (a new volume in another zone or cluster, a lost one): the store is cloned from
the remote, where the server pushed every commit. A clone that was cut short (the pod deleted
mid-way) leaves ``<store>.cloning`` behind and is finished on the next start; a remote with
no thread yet (a new user) is not an error. A new user's empty remote is made an encrypted
one with the pod's key (``INFINIJUP_STORE_PASSWORD_FILE``, from a Secret): the server's
background push needs it to be (docs/store.md, "Remotes: encryption and keys").

Hibernation records (``<store>-hibernated/``) are not on the remote: after a clone the
hibernated kernel is in the notebook's history (Resume), but does not wake by itself.

Exit status: 0 (nothing to do, or cloned), 2 (failed; the message says why).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def restore(store: Path, url: str) -> str:
    """Clone ``url`` into ``store`` unless a store is already there; returns what was done."""
    from infinijup.store.remote import clone, remote_threads
    from infinijup.store.s3 import S3Bucket

    marker = store.with_name(store.name + ".cloning")
    if store.exists() and not marker.exists():
        return f"{store} is there: nothing to restore"
    bucket = S3Bucket(url)
    bucket.check_bucket()
    made = encrypt_if_new(bucket)
    threads = remote_threads(bucket)
    if not threads:
        marker.unlink(missing_ok=True)
        return f"{made}{url} has no thread yet: nothing to restore"
    store.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    repo, reports = clone(url, store)
    repo.close()
    marker.unlink()
    moved = sum(r.bytes_downloaded for r in reports)
    return f"cloned {len(reports)} threads ({moved} bytes) from {url} into {store}"


def encrypt_if_new(bucket) -> str:  # noqa: ANN001 - an S3Bucket (imported late)
    """A new user's remote (nothing under its prefix) is made an encrypted one with the pod's
    key ($INFINIJUP_STORE_PASSWORD_FILE or $INFINIJUP_STORE_KEY_FILE), so that the server's
    background push, which refuses a remote that is not encrypted while a key is given, can
    go. Without a key, or on a remote that holds anything, nothing is done. What was done."""
    from infinijup.store.keys import Credentials, init_remote, read_config

    creds = Credentials.from_env()
    if not creds.has_key or read_config(bucket) is not None or bucket.list(""):
        return ""
    opened = init_remote(bucket, creds, label="pod")
    return f"made {bucket.url} an encrypted remote (key slot {opened.slot}); "


def main() -> int:
    from infinijup.errors import InfinijupError
    from infinijup.store.repository import default_store_path

    url = os.environ.get("INFINIJUP_REMOTE", "")
    if not url:
        return 0
    store = Path(default_store_path())
    try:
        print(f"infinijup restore-store: {restore(store, url)}", file=sys.stderr)
    except (InfinijupError, OSError) as exc:
        reason = getattr(exc, "reason", type(exc).__name__)
        print(f"infinijup restore-store: {url} -> {store} failed: {exc} [{reason}]; the next "
              "start tries again", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
