"""Putting a snapshot into another kernel session: which endpoints move, which key it signs with.

A kernel is dumped listening on its session's endpoints: ZMQ ipc sockets under a directory only
its owner can enter (infinijup/endpoints.py). Any Infinijup kernel of the same user can take it:
the helper binds the saved socket paths to the target session's instead
(infinijup_helper/retarget.py). Each kernel session has a key of its own; the restored kernel
still signs with the key of the kernel that was dumped, so the server talks to it with that key
until the adopt step (:func:`adopt_expression`) has given it the session's key. A key carried by
a commit therefore opens only kernels restored from that commit, and only until they are
adopted. Nothing of the user's state changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PreflightRefused

PORT_NAMES = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
_SAME = ("transport", "signature_scheme")
IPC = "ipc"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


def saved_connection(info: dict) -> dict:
    """What a snapshot records of its kernel's connection (kept server-side only: the key is
    never shown, logged or sent to the browser)."""
    out = {k: info.get(k) for k in (*_SAME, "ip", *PORT_NAMES)}
    out["key"] = _text(info.get("key"))
    return out


def endpoint_paths(info: dict) -> dict[str, str]:
    """The unix socket path of each channel of an ipc connection (ZMQ's ``ip-port``), and of
    the kernel's subprocess pipe (kernel_magics/ipc_pipe.py)."""
    paths = {n: f"{info['ip']}-{int(info[n])}" for n in PORT_NAMES if info.get(n)}
    if info.get("ip"):
        paths["pipe"] = f"{info['ip']}-pipe"
    return paths


@dataclass(frozen=True)
class Retarget:
    path_map: tuple[tuple[str, str], ...] = ()  # (saved socket path, target path), those that differ
    saved_key: bytes | None = None  # the restored kernel's key, where it is not the session's

    @property
    def same_session(self) -> bool:
        return not self.path_map and self.saved_key is None


def why_not_retargetable(saved: dict, target: dict) -> str | None:
    """Why a kernel saved with connection ``saved`` cannot go into session ``target``."""
    if saved and saved.get("transport") != IPC and target.get("transport") == IPC:
        return ("this snapshot's kernel listened on TCP ports, which other accounts of this "
                "machine can reach (it was taken before Infinijup moved kernels to owner-only "
                "unix sockets): it cannot be restored into today's kernels")
    for name in _SAME:
        if saved.get(name) and target.get(name) and saved[name] != target[name]:
            return (f"this snapshot's kernel used {name} {saved[name]!r}, the target kernel "
                    f"uses {target[name]!r}")
    if not saved.get("key"):
        return ("this snapshot was taken before Infinijup recorded its kernel's connection: "
                "it can only go back into the kernel session that took it")
    return None


def plan_retarget(saved: dict, target: dict) -> Retarget:
    """How a kernel saved with connection ``saved`` goes into the session ``target``; refused
    (422, before any kernel is touched) where it cannot."""
    if not saved:
        return Retarget()  # nothing recorded: as it comes
    reason = why_not_retargetable(saved, target)
    if reason is not None:
        raise PreflightRefused(reason, reason="not_resumable_here")
    old, new = endpoint_paths(saved), endpoint_paths(target)
    path_map = tuple((old[n], new[n]) for n in (*PORT_NAMES, "pipe")
                     if n in old and n in new and old[n] != new[n])
    key = _text(saved.get("key"))
    return Retarget(path_map, None if key == _text(target.get("key")) else key.encode())


def adopt_expression(kernel_id: str, server_url: str, results_dir: str,
                     connection_file: str | None = None, ip: str | None = None,
                     rekey: bool = False) -> str:
    """The user expression that tells a restored kernel which kernel it now is, and which server
    it now belongs to (its URL, the directory its answers land in, its connection file, its
    endpoints' path prefix). With ``rekey`` it takes the session's key from the connection
    file (owner-only), so the key never travels in a message."""
    return (f"__import__('infinijup.kernel_magics.retarget', fromlist=['_'])"
            f".adopt({kernel_id!r}, {server_url!r}, {results_dir!r}, {connection_file!r}, "
            f"{ip!r}, {rekey!r})")
