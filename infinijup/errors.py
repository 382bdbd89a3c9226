"""The one error hierarchy of Infinijup.

Every error a user can meet derives from :class:`InfinijupError`. Each carries a short
machine-readable ``reason`` (stable, snake_case) and a human message saying what happened and
what to do. The web layer maps each family to an HTTP status via ``http_status``.
"""

from __future__ import annotations


class InfinijupError(Exception):
    """Base of every error Infinijup raises on purpose."""

    reason: str = "error"
    http_status: int = 500

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason

    @property
    def message(self) -> str:
        return str(self)


class BadRequest(InfinijupError):
    """The request itself is malformed (400)."""

    reason = "bad_request"
    http_status = 400


class NotFound(InfinijupError):
    """A named kernel, commit, thread or file does not exist (404)."""

    reason = "not_found"
    http_status = 404


class Conflict(InfinijupError):
    """Another operation is running, or the kernel is busy (409)."""

    reason = "conflict"
    http_status = 409


class PreflightRefused(InfinijupError):
    """The operation was refused before it started; the message says why and what to do (422)."""

    reason = "preflight_refused"
    http_status = 422


class PermissionDenied(InfinijupError):
    """The caller may not act on this kernel or snapshot (403)."""

    reason = "permission_denied"
    http_status = 403


class HelperError(InfinijupError):
    """The privileged helper failed or could not be reached (500/503)."""

    reason = "helper_error"
    http_status = 500


class HelperUnavailable(HelperError):
    reason = "helper_unavailable"
    http_status = 503


class SnapshotFailed(InfinijupError):
    """A snapshot failed; the kernel was resumed and the store left consistent."""

    reason = "snapshot_failed"
    http_status = 500


class KernelUnsavable(SnapshotFailed):
    """The kernel holds something no snapshot can carry, found by CRIU as it dumped; the
    kernel was resumed as it was, and the message says what to do (422)."""

    reason = "unsavable"
    http_status = 422


class RestoreFailed(InfinijupError):
    """A restore failed; the kernel that ran before is still usable or was restarted."""

    reason = "restore_failed"
    http_status = 500
