"""Starting a kernel tree: the helper runs nsinit.py's launcher and reads back the init's pid.

The launcher and the init live in nsinit.py (one standalone file, copied where every user can
read it); this module is the helper's side: the validated spec, and :func:`spawn_tree`.
``subprocess`` forks in C and execs at once, so the launcher starts single-threaded and clean.
"""

from __future__ import annotations

import json
import logging
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpawnSpec:
    """Everything the launcher needs, already validated and confined by the helper."""

    argv: Sequence[str]
    env: Mapping[str, str]
    cwd: str
    log_path: str
    uid: int
    gid: int
    groups: Sequence[int]
    python: str
    nsinit_path: str
    nsinit_cwd: str
    pid_namespace: bool = True
    nsinit_group: int | None = None  # the init's extra group (non-root, PID namespace)
    rlimits: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    cgroup_procs: str | None = None  # the caller's cgroup (see cgroups.py)


class SpawnFailed(Exception):
    """The tree could not be started; the message says which step failed and why."""


def spawn_tree(spec: SpawnSpec, timeout: float = 30.0) -> int:
    """Start the tree: nsinit as its init (PID 1 of a new PID namespace, unless told not to),
    ARGV as ``spec.uid`` below it.

    Returns the init's host pid once ARGV has been executed; raises :class:`SpawnFailed`
    naming the step that failed otherwise (nothing is left running then).
    """
    try:
        done = subprocess.run(
            [spec.python, "-I", spec.nsinit_path, "launch"],
            input=json.dumps(asdict(spec)).encode(),
            capture_output=True,
            env={},
            cwd="/",
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise SpawnFailed("the namespace launcher did not answer in time") from None
    try:
        answer = json.loads(done.stdout.decode() or "null")
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        err = done.stderr.decode(errors="replace").strip()[-2000:]
        raise SpawnFailed(f"the namespace launcher failed (exit {done.returncode}): {err}")
    if "error" in answer:
        raise SpawnFailed(str(answer["error"]))
    return int(answer["pid"])
