"""Errors of the snapshot store.

Every error derives from :class:`StoreError`, which derives from the project's
:class:`~infinijup.errors.InfinijupError`; each family also derives from the matching
project family (``NotFound``, ``BadRequest``, ``Conflict``) so callers and the web layer map
them without knowing the store. Each class carries a stable snake_case ``reason``.
"""

from __future__ import annotations

from infinijup.errors import BadRequest, Conflict, InfinijupError, NotFound, PermissionDenied


class StoreError(InfinijupError):
    """Base of every error the store raises on purpose."""

    reason = "store_error"


class StoreNotFound(StoreError, NotFound):
    """No store exists at the given path."""

    reason = "store_not_found"


class StoreExists(StoreError, Conflict):
    """``init`` was asked to create a store where one (or other files) already exists."""

    reason = "store_exists"


class UnsupportedFormat(StoreError):
    """The store's config names a format or version this code does not understand."""

    reason = "store_unsupported_format"


class StoreLocked(StoreError, Conflict):
    """The store lock could not be taken within the timeout."""

    reason = "store_locked"


class UnknownRef(StoreError, NotFound):
    """A ref (thread name, commit id or id prefix) names no commit."""

    reason = "unknown_ref"


class AmbiguousRef(StoreError, BadRequest):
    """An id prefix matches more than one commit."""

    reason = "ambiguous_ref"


class InvalidRef(StoreError, BadRequest):
    """A ref or thread name is malformed (e.g. an id prefix shorter than 8 hex digits)."""

    reason = "invalid_ref"


class InvalidTree(StoreError, BadRequest):
    """Entries given to build a tree are malformed (bad name, unknown entry type)."""

    reason = "invalid_tree"


class CheckoutTargetNotEmpty(StoreError, BadRequest):
    """``checkout_dir`` was pointed at a path that exists and is not an empty directory."""

    reason = "checkout_target_not_empty"


class RefConflict(StoreError, Conflict):
    """A compare-and-swap on a thread ref found a different tip than expected."""

    reason = "ref_conflict"


class ObjectMissing(StoreError, NotFound):
    """An object a commit needs is not in the index or its pack is gone."""

    reason = "object_missing"


class ChecksumMismatch(StoreError):
    """An object's content does not hash to its id: the stored bytes are damaged."""

    reason = "checksum_mismatch"


class CorruptPack(StoreError):
    """A pack file's trailer or header is malformed or truncated."""

    reason = "corrupt_pack"


class CorruptObject(StoreError):
    """A commit, tree or blob object does not decode (its hash may still match)."""

    reason = "corrupt_object"


class IndexCorrupt(StoreError):
    """The SQLite index cannot be read; run ``infinijup store rebuild-index``."""

    reason = "index_corrupt"


class StoreWrongKey(StoreError, PermissionDenied):
    """An encrypted local store's keys do not open with what was given: a wrong password or
    key file, a removed key slot, or no key at all."""

    reason = "store_wrong_key"
    http_status = 403


class RemoteError(StoreError):
    """A push, pull or clone to or from a remote (S3) store failed; the message says why."""

    reason = "remote_error"
    http_status = 502


class RemoteUnavailable(RemoteError):
    """The remote's server could not be reached (or stopped answering mid-transfer)."""

    reason = "remote_unavailable"
    http_status = 503


class RemoteAuthFailed(RemoteError, PermissionDenied):
    """The remote refused the credentials, or none were found."""

    reason = "remote_auth_failed"
    http_status = 403


class RemoteNotFound(RemoteError, NotFound):
    """The bucket, or a thread or commit asked for, does not exist on the remote."""

    reason = "remote_not_found"
    http_status = 404


class RemoteCorrupt(RemoteError):
    """Something fetched from the remote does not verify (hash, header, missing pack)."""

    reason = "remote_corrupt"


class RemoteConflict(RemoteError, RefConflict):
    """A thread on the remote moved under us, or diverged from the local one."""

    reason = "remote_conflict"
    http_status = 409


class RemoteKeyRequired(RemoteError, PermissionDenied):
    """The remote is encrypted and no key (password or key file) was given."""

    reason = "remote_key_required"
    http_status = 403


class RemoteWrongKey(RemoteError, PermissionDenied):
    """No key slot of the encrypted remote opens with the password or key file given."""

    reason = "remote_wrong_key"
    http_status = 403


class RemoteNotEncrypted(RemoteError, BadRequest):
    """A push to a remote without encryption was not asked for explicitly, or a key was given
    for a remote that is not encrypted."""

    reason = "remote_not_encrypted"
    http_status = 400


class RemoteKeyError(RemoteError, BadRequest):
    """A key-slot command was refused (unknown slot, the last one, the one in use, ...)."""

    reason = "remote_key_error"
    http_status = 400


class RemoteReplayed(RemoteCorrupt):
    """A thread's ref on the remote is older than one this store already saw there: an old
    ref put back (replayed or rolled back)."""

    reason = "remote_replayed"
