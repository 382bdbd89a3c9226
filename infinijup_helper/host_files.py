"""Are the files a restored tree reopens by path here, as they were dumped?

CRIU reopens every regular file and directory the tree held (its working directory, the data
files a notebook had open, the libraries it mapped) by path, and refuses one whose size or mode
is not what it dumped. On another machine, or after such a file was removed or changed, that
refusal comes only after the kernel being replaced was killed. This restore stage checks first,
before anything is touched, and names every file that is absent, or (regular files) of another
size or mode; directories only need to exist (CRIU still compares their modes, and library build
ids, itself). Deleted files CRIU carries in the images (ghost files) and other remapped ones, and
files under /proc, are left to CRIU.

The files are looked at with the caller's credentials, as CRIU will open them: a small ``stat``
process runs as the caller (setpriv, no capability), so a path in the images can tell the
caller nothing about a file they could not look at themselves.
"""

from __future__ import annotations

import errno
import json
import stat
import subprocess

from .creds import RunAs, find_setpriv
from .criu import Criu, image_names
from .protocol import RequestError
from .stages import StageBase

FILES_IMAGE = "files.img"
REMAPS_IMAGE = "remap-fpath.img"
MOST_NAMED = 10
STAT_TIMEOUT_S = 120.0  # a hang guard (a stalled network filesystem), never reached otherwise

# Run with ``python -I -S -c``: stats each path of the JSON list on stdin, as whoever runs it.
_STAT_CODE = """
import json, os, sys
def one(path):
    try:
        st = os.stat(path)
    except OSError as exc:
        return [exc.errno, exc.strerror or str(exc)]
    return [0, st.st_size, st.st_mode]
json.dump([one(p) for p in json.load(sys.stdin)], sys.stdout)
"""


def reopened_files(criu: Criu, dir_fd: int) -> dict[str, dict]:
    """Path -> its regular-file entry, for each file of the images CRIU reopens by path."""
    names = set(image_names(dir_fd))
    if FILES_IMAGE not in names:
        return {}
    remapped = set()
    if REMAPS_IMAGE in names:
        remapped = {e.orig_id for e in criu.messages(dir_fd, REMAPS_IMAGE, "REMAP_FPATH",
                                                     "remap_file_path_entry")}
    out: dict[str, dict] = {}
    for entry in criu.messages(dir_fd, FILES_IMAGE, "FILES", "file_entry"):
        if not entry.HasField("reg") or entry.reg.id in remapped:
            continue
        reg = entry.reg
        if reg.name.startswith("/") and not reg.name.startswith("/proc/"):
            out.setdefault(reg.name, _as_dict(reg))
    return out


def _as_dict(reg) -> dict:  # noqa: ANN001 - a reg_file_entry message
    """The fields ``differences`` reads, as load_image's dicts name them."""
    out: dict = {"id": reg.id, "name": reg.name}
    if reg.HasField("size"):
        out["size"] = reg.size
    if reg.HasField("mode"):
        out["mode"] = reg.mode
    return out


def stat_as(run_as: RunAs | None, python: str, paths: list[str]) -> list[list]:
    """``os.stat`` of each path by a process with ``run_as``'s credentials (None: root)."""
    argv = [python, "-I", "-S", "-c", _STAT_CODE]
    if run_as is not None:
        argv = RunAs(run_as.uid, run_as.gid, run_as.groups).setpriv_argv(find_setpriv()) + argv
    try:
        done = subprocess.run(argv, input=json.dumps(paths).encode(), capture_output=True,
                              env={}, cwd="/", timeout=STAT_TIMEOUT_S, check=False)
        answer = json.loads(done.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        raise RequestError("helper_error", f"cannot check the snapshot's files: {exc}") from None
    if not isinstance(answer, list) or len(answer) != len(paths):
        raise RequestError("helper_error", "cannot check the snapshot's files: "
                           + done.stderr.decode(errors="replace")[-500:])
    return answer


def differences(files: dict[str, dict], stats: list[list]) -> list[str]:
    """In words, each file that is not here as it was dumped."""
    out = []
    for (path, reg), got in zip(files.items(), stats, strict=True):
        if got[0] == errno.ENOENT:
            out.append(f"{path} (absent)")
        elif got[0] != 0:
            out.append(f"{path} ({got[1]})")
        elif stat.S_ISDIR(int(reg.get("mode", 0))) and stat.S_ISDIR(got[2]):
            continue  # a directory: it exists
        elif "size" in reg and got[1] != int(reg["size"]):
            out.append(f"{path} ({got[1]} bytes here, {reg['size']} when dumped)")
        elif "mode" in reg and got[2] != int(reg["mode"]):
            out.append(f"{path} (mode {got[2]:o} here, {int(reg['mode']):o} when dumped)")
    return out


class CheckHostFiles(StageBase):
    """The restore stage after the images are staged and retargeted, before the kill."""

    name = "files"

    def __init__(self, criu: Criu, python: str) -> None:
        self.criu = criu
        self.python = python

    def run(self, job) -> None:  # noqa: ANN001 - checkpoint.RestoreJob
        files = reopened_files(self.criu, job.staging.fd)
        if not files:
            return
        wrong = differences(files, stat_as(job.run_as, self.python, list(files)))
        if wrong:
            more = len(wrong) - MOST_NAMED
            raise RequestError(
                "missing_files",
                "the snapshot's processes held files that are not here as they were: "
                + ", ".join(wrong[:MOST_NAMED]) + (f" and {more} more" if more > 0 else "")
                + ". Copy them to the same paths (a notebook's files come with its directory), "
                "or restore where they are; nothing was touched")
