"""Sidecars: processes a notebook starts that belong to its kernel (issue 17).

``%sidecar start NAME -- CMD ...`` starts CMD as a child of the kernel, so it is in the
kernel's process tree: every snapshot dumps it with the kernel (its memory, its listening and
connected sockets, its open files, its GPU state through the helper) and every restore brings it
back, answering on the same ports. Its output goes to a log file; it ends with the kernel (a
parent-death signal, and the kernel's tree is ended with the kernel); ``stop`` ends its process
group (TERM, then KILL).

A sidecar that serves requests can be parked for each snapshot, like an engine in the kernel
(engines.py): ``--pause URL`` and ``--resume URL`` are POSTed to before the quiesce and after the
snapshot or a restore (``vllm serve``: ``/pause?mode=keep`` and ``/resume``). Without them the
sidecar is frozen as it is, in the same instant as the kernel, which is consistent but not parked.

A sidecar's log lives under Jupyter's runtime directory, ``infinijup-sidecars/<kernel
id>/NAME.log``; a restore reopens it there (leave it in place while its snapshots matter).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from . import engines

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
PR_SET_PDEATHSIG = 1


class SidecarError(Exception):
    pass


@dataclass
class Sidecar:
    name: str
    argv: list[str]
    log: str
    popen: subprocess.Popen
    started: float = field(default_factory=time.time)
    pause_url: str | None = None
    resume_url: str | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def status(self) -> dict:
        code = self.popen.poll()
        return {"name": self.name, "argv": self.argv, "pid": self.pid, "log": self.log,
                "running": code is None, "exit_code": code, "started": self.started,
                "pause_url": self.pause_url, "resume_url": self.resume_url}


_sidecars: dict[str, Sidecar] = {}


def log_dir() -> str:
    from jupyter_core.paths import jupyter_runtime_dir

    from .. import config

    kernel = os.environ.get(config.KERNEL_ID_ENV) or f"pid-{os.getpid()}"
    return os.path.join(jupyter_runtime_dir(), "infinijup-sidecars", kernel)


def _die_with_parent() -> None:  # in the child, before exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except Exception:
        pass


def start(name: str, argv: list[str], cwd: str | None = None,
          pass_fds: tuple[int, ...] = (), pause_url: str | None = None,
          resume_url: str | None = None) -> Sidecar:
    """Start ``argv`` as the sidecar ``name`` (a name not running already); with
    ``pause_url``/``resume_url``, park it for each snapshot through them."""
    if not NAME.match(name or ""):
        raise SidecarError(f"bad sidecar name {name!r} (letters, digits, '_', '.', '-')")
    if not argv:
        raise SidecarError("no command: %sidecar start NAME -- CMD ...")
    if (pause_url is None) != (resume_url is None):
        raise SidecarError("--pause and --resume go together")
    for url in (pause_url, resume_url):
        if url is not None and urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise SidecarError(f"not an http(s) URL: {url!r}")
    old = _sidecars.get(name)
    if old is not None and old.popen.poll() is None:
        raise SidecarError(f"sidecar {name!r} is running (pid {old.pid}); stop it first")
    os.makedirs(log_dir(), mode=0o700, exist_ok=True)
    log = os.path.join(log_dir(), f"{name}.log")
    with open(log, "ab") as out:
        try:
            popen = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     pass_fds=pass_fds, preexec_fn=_die_with_parent)
        except OSError as exc:
            raise SidecarError(f"cannot start {argv[0]!r}: {exc.strerror or exc}") from None
    sidecar = Sidecar(name, list(argv), log, popen, pause_url=pause_url, resume_url=resume_url)
    _sidecars[name] = sidecar
    engines.unregister_engine(f"sidecar:{name}")
    if pause_url is not None:
        engines.register_engine(pause=lambda: _post_if_running(sidecar, pause_url),
                                resume=lambda: _post_if_running(sidecar, resume_url),
                                name=f"sidecar:{name}")
    return sidecar


def _post_if_running(sidecar: Sidecar, url: str, timeout: float = 300.0) -> None:
    """POST to a sidecar's pause or resume URL (nothing when it has exited)."""
    if sidecar.popen.poll() is not None:
        return
    request = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        answer.read()


def stop(name: str, timeout: float = 10.0) -> int | None:
    """End the sidecar's process group: TERM, then KILL after ``timeout`` s. Its exit code."""
    sidecar = _get(name)
    engines.unregister_engine(f"sidecar:{name}")
    if sidecar.popen.poll() is None:
        _signal_group(sidecar, signal.SIGTERM)
        try:
            sidecar.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal_group(sidecar, signal.SIGKILL)
            sidecar.popen.wait()
    return sidecar.popen.returncode


def _signal_group(sidecar: Sidecar, signum: int) -> None:
    try:
        os.killpg(sidecar.pid, signum)  # its own session: its pgid is its pid
    except ProcessLookupError:
        pass


def _get(name: str) -> Sidecar:
    sidecar = _sidecars.get(name)
    if sidecar is None:
        known = ", ".join(sorted(_sidecars)) or "none"
        raise SidecarError(f"no sidecar {name!r} (sidecars: {known})")
    return sidecar


def listing() -> list[dict]:
    return [s.status() for _, s in sorted(_sidecars.items())]


def logs(name: str, lines: int = 50) -> str:
    """The last ``lines`` lines of the sidecar's output."""
    sidecar = _get(name)
    try:
        with open(sidecar.log, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            tail = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    return "\n".join(tail.splitlines()[-lines:])


def describe() -> list[dict]:
    """For a snapshot's metadata: each sidecar, whether it runs, what it runs."""
    return [{"name": s["name"], "argv": [a[:200] for a in s["argv"][:20]], "pid": s["pid"],
             "running": s["running"]} for s in listing()]
