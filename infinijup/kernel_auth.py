"""How a kernel proves to its Jupyter server that a request comes from it, without a token.

A kernel already holds one secret the server knows: the HMAC key it signs its Jupyter messages
with (its session's own key: engine/retarget.py). The magics sign each request to ``/infinijup/*`` with that key, so the
server's token never has to enter the kernel, its environment, or any snapshot of it
(docs/security.md). The signature covers the method, the path with its query, the body, the kernel
id and the time; the server checks it against the key of the kernel the request names.

    Authorization: Infinijup-Kernel id=<kernel id>,ts=<unix seconds>,sig=<hex HMAC-SHA256>
"""

from __future__ import annotations

import hashlib
import hmac

SCHEME = "Infinijup-Kernel"
MAX_SKEW_S = 300  # a request signed this long ago (or ahead) is refused


class BadSignature(ValueError):
    """The Authorization header is not a valid kernel signature (the message says why)."""


def _message(kernel_id: str, method: str, uri: str, body: bytes, ts: int) -> bytes:
    digest = hashlib.sha256(body).hexdigest()
    return f"{method.upper()}\n{uri}\n{ts}\n{kernel_id}\n{digest}".encode()


def sign(key: bytes, kernel_id: str, method: str, uri: str, body: bytes, now: float) -> str:
    """The Authorization header value for one request."""
    ts = int(now)
    sig = hmac.new(key, _message(kernel_id, method, uri, body, ts), hashlib.sha256).hexdigest()
    return f"{SCHEME} id={kernel_id},ts={ts},sig={sig}"


def claimed_kernel(header: str) -> str | None:
    """The kernel id a header of this scheme names; None for any other kind of header."""
    if not header.startswith(SCHEME + " "):
        return None
    return _fields(header).get("id") or None


def verify(key: bytes, header: str, method: str, uri: str, body: bytes, now: float) -> str:
    """The kernel id of a valid signature; BadSignature otherwise."""
    fields = _fields(header)
    kernel_id, ts, sig = fields.get("id"), fields.get("ts"), fields.get("sig")
    if not kernel_id or not ts or not sig or not ts.isdigit():
        raise BadSignature("malformed kernel signature")
    if abs(now - int(ts)) > MAX_SKEW_S:
        raise BadSignature("the kernel signature has expired")
    good = hmac.new(key, _message(kernel_id, method, uri, body, int(ts)), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(good, sig):
        raise BadSignature("the kernel signature does not match")
    return kernel_id


def _fields(header: str) -> dict[str, str]:
    _, _, rest = header.partition(" ")
    fields: dict[str, str] = {}
    for part in rest.split(","):
        name, sep, value = part.strip().partition("=")
        if sep:
            fields[name] = value
    return fields
