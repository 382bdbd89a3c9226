"""Restoring a kernel's images into another kernel session: other endpoints, another log file.

A kernel listens on the ports of the session that started it, and CRIU gives a restored kernel
the very sockets it had. To restore a snapshot into another session (a new kernel, a second one
side by side, a server that restarted), the staged ``files.img`` is rewritten before CRIU reads
it: each TCP socket bound to a saved port is bound to that session's port instead, and the
kernel's stdout/stderr log (opened with O_APPEND, so CRIU records no size for it) becomes the
new session's log. Nothing inside the kernel changes: ZMQ keeps the same descriptors, now bound
elsewhere. A kernel listening on unix sockets (ZMQ ipc endpoints) has their saved paths
replaced by the session's the same way. Other listening TCP sockets whose saved port is taken on this machine (ipykernel's
IOPub thread binds a random port of its own; a copy restored beside the kernel it came from
finds it held) move to a free port the same way.

This runs on the root-only staged copy, after the images were checked against their seal, so
what CRIU reads is exactly what was sealed plus these edits, which the helper itself made from
validated arguments: new ports must be ports the caller could bind itself, and the new log is
a file of the caller's own work dir (confined by the caller of :func:`retarget_images`).
"""

from __future__ import annotations

import errno
import os
import re
import socket
import struct
from dataclasses import dataclass

from .criu import Criu
from .protocol import RequestError
from .stages import StageBase

FILES_IMAGE = "files.img"
_KERNEL_LOG = re.compile(r"^kernel-[A-Za-z0-9_.-]+\.log$")
TCP = 6
TCP_LISTEN = 10


def unprivileged_port_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_unprivileged_port_start") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 1024


@dataclass(frozen=True)
class RetargetPlan:
    port_map: tuple[tuple[int, int], ...] = ()
    # unix socket paths (saved -> new): the kernel's ZMQ ipc endpoints. CRIU binds them as the
    # caller, so a path the caller could not bind itself fails the restore, as it should.
    path_map: tuple[tuple[str, str], ...] = ()
    log_path: str | None = None  # the new kernel log, already confined to the caller's work dir

    @property
    def empty(self) -> bool:
        return not self.port_map and not self.path_map and self.log_path is None


def check_ports(plan: RetargetPlan, caller_is_root: bool) -> None:
    """A caller may only move its sockets to ports it could bind itself."""
    if caller_is_root:
        return
    lowest = unprivileged_port_start()
    for _, new in plan.port_map:
        if new < lowest:
            raise RequestError("permission_denied",
                               f"port {new} is privileged (below {lowest}) on this machine")


def retarget_images(criu: Criu, dir_fd: int, plan: RetargetPlan) -> dict[str, int]:
    """Rewrite ``files.img`` in the staging dir ``dir_fd``; return what was changed."""
    if plan.empty:
        return {"ports": 0, "paths": 0, "logs": 0}
    image = criu.load_image(dir_fd, FILES_IMAGE)
    ports = dict(plan.port_map)
    if ports:
        ports.update(_busy_listeners(image, ports))
    log_dir, log_name = os.path.split(plan.log_path) if plan.log_path else (None, None)
    paths = {old.encode(): new.encode() for old, new in plan.path_map}
    changed_ports = changed_paths = changed_logs = 0
    for entry in image.get("entries", []):
        usk = entry.get("usk") if entry.get("type") == "UNIXSK" else None
        if usk is not None and paths and _rename_unix(criu, usk, paths):
            changed_paths += 1
        isk = entry.get("isk") if entry.get("type") == "INETSK" else None
        if isk is not None and isk.get("proto") == TCP and isk.get("src_port") in ports:
            isk["src_port"] = ports[isk["src_port"]]
            changed_ports += 1
        reg = entry.get("reg") if entry.get("type") == "REG" else None
        if reg is not None and log_dir is not None:
            head, tail = os.path.split(reg.get("name", ""))
            if head == log_dir and _KERNEL_LOG.match(tail) and tail != log_name:
                reg["name"] = plan.log_path
                changed_logs += 1
    _write_image(criu, dir_fd, image)
    return {"ports": changed_ports, "paths": changed_paths, "logs": changed_logs}


def _rename_unix(criu: Criu, usk: dict, paths: dict[bytes, bytes]) -> bool:
    """Bind a unix socket of the image to its new path, if its saved path moves. pycriu
    carries names quoted-printable; the kernel may keep a trailing NUL in them."""
    codec = criu.pycriu.images.pb2dict
    raw = codec.decode_unix(usk.get("name") or b"")
    if isinstance(raw, str):
        raw = raw.encode()
    path, nul, rest = raw.partition(b"\0")
    if path not in paths or rest.strip(b"\0"):
        return False
    new = paths[path] + nul + rest
    usk["name"] = codec.encode_unix(new).decode() if isinstance(usk.get("name"), str) \
        else codec.encode_unix(new)
    return True


def _address(isk: dict) -> tuple[int, str] | None:
    words = isk.get("src_addr") or []
    if isk.get("family") == socket.AF_INET and len(words) == 1:
        return socket.AF_INET, socket.inet_ntop(socket.AF_INET, struct.pack("<I", words[0]))
    if isk.get("family") == socket.AF_INET6 and len(words) == 4:
        return socket.AF_INET6, socket.inet_ntop(socket.AF_INET6, struct.pack("<4I", *words))
    return None


def _busy_listeners(image: dict, taken: dict[int, int]) -> dict[int, int]:
    """A free port for each listening TCP socket of the image whose port is in use here."""
    moved: dict[int, int] = {}
    for entry in image.get("entries", []):
        isk = entry.get("isk") if entry.get("type") == "INETSK" else None
        if (isk is None or isk.get("proto") != TCP or isk.get("state") != TCP_LISTEN
                or isk.get("src_port") in taken or isk.get("src_port") in moved):
            continue
        where = _address(isk)
        if where is None:
            continue
        family, host = where
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, isk["src_port"]))
                continue  # free: it keeps its port
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    continue
            probe.bind((host, 0))
            moved[isk["src_port"]] = probe.getsockname()[1]
    return moved


def _write_image(criu: Criu, dir_fd: int, image: dict) -> None:
    tmp = f".{FILES_IMAGE}.retarget"
    # CRIU restores as the images' owner (creds.py): the new image is theirs, like the old one
    old = os.stat(FILES_IMAGE, dir_fd=dir_fd, follow_symlinks=False)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dir_fd)
    try:
        os.fchown(fd, old.st_uid, old.st_gid)
        with os.fdopen(fd, "wb") as f:
            criu.pycriu.images.dump(image, f)
        os.rename(tmp, FILES_IMAGE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


class RetargetImages(StageBase):
    """The restore stage: after the images are staged and checked, before anything is killed."""

    name = "retarget"

    def __init__(self, criu: Criu) -> None:
        self.criu = criu

    def run(self, job) -> None:  # noqa: ANN001 - checkpoint.RestoreJob
        plan: RetargetPlan = job.retarget
        check_ports(plan, job.caller.is_root)
        job.retargeted = retarget_images(self.criu, job.staging.fd, plan)
