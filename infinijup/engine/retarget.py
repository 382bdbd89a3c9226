"""Putting a snapshot into another kernel session: which ports move.

A kernel is dumped listening on its session's ports. Any Infinijup kernel of the same user can
take it: the helper rebinds the saved ports to the target kernel's
(infinijup_helper/retarget.py), and since every kernel of a user signs with the same key
(infinijup/kernel_key.py), the target session's clients talk to the restored kernel as they
did to the one it replaced. Afterwards the kernel is told its new kernel id
(:func:`adopt_expression`); nothing of the user's state changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PreflightRefused

PORT_NAMES = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
_SAME = ("transport", "ip", "signature_scheme")


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


def saved_connection(info: dict) -> dict:
    """What a snapshot records of its kernel's connection (kept server-side only)."""
    out = {k: info.get(k) for k in (*_SAME, *PORT_NAMES)}
    out["key"] = _text(info.get("key"))
    return out


@dataclass(frozen=True)
class Retarget:
    port_map: tuple[tuple[int, int], ...]  # (saved port, target port), only those that differ

    @property
    def same_session(self) -> bool:
        return not self.port_map


def why_not_retargetable(saved: dict, target: dict) -> str | None:
    """Why a kernel saved with connection ``saved`` cannot go into session ``target``."""
    for name in _SAME:
        if saved.get(name) and target.get(name) and saved[name] != target[name]:
            return (f"this snapshot's kernel used {name} {saved[name]!r}, the target kernel "
                    f"uses {target[name]!r}")
    if not saved.get("key"):
        return ("this snapshot was taken before Infinijup recorded its kernel's connection: "
                "it can only go back into the kernel session that took it")
    if saved["key"] != _text(target.get("key")):
        return ("this snapshot's kernel signs with another key than this user's Infinijup "
                "kernels (made by another account, or before the key file was replaced, or on "
                "another machine: copy that machine's ~/.local/share/infinijup/kernel.key, or "
                "$INFINIJUP_KERNEL_KEY_FILE, to the same place here): it can only go back "
                "into the kernel session that took it")
    return None


def plan_retarget(saved: dict, target: dict) -> Retarget:
    """How a kernel saved with connection ``saved`` goes into the session ``target``; refused
    (422, before any kernel is touched) where it cannot."""
    port_map = tuple((int(saved[n]), int(target[n])) for n in PORT_NAMES
                     if saved.get(n) and target.get(n) and int(saved[n]) != int(target[n]))
    if not saved or (not port_map and _text(saved.get("key")) in ("", _text(target.get("key")))):
        return Retarget(())  # the session that took it (or nothing recorded): as it comes
    reason = why_not_retargetable(saved, target)
    if reason is not None:
        raise PreflightRefused(reason, reason="not_resumable_here")
    return Retarget(port_map)


def adopt_expression(kernel_id: str, server_url: str, results_dir: str,
                     connection_file: str | None = None) -> str:
    """The user expression that tells a restored kernel which kernel it now is, and which server
    it now belongs to (its URL, the directory its answers land in, its connection file)."""
    return (f"__import__('infinijup.kernel_magics.retarget', fromlist=['_'])"
            f".adopt({kernel_id!r}, {server_url!r}, {results_dir!r}, {connection_file!r})")
