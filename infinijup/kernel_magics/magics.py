"""``%snapshot``, ``%restore``, ``%snapshots``, ``%branch``, ``%hibernate``, ``%autosnapshot``,
``%undo`` and ``%redo``: Infinijup from inside a notebook.

A magic that fails raises :class:`MagicError`: the cell fails (``execute_reply`` status
"error", the notebook shows the message as an error) and "Run All" stops there.
``%snapshots`` is named apart from IPython's ``%history``, which it must not shadow.
"""

from __future__ import annotations

import shlex
import threading

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..errors import InfinijupError
from . import autosnap, sidecars, snapshot_call
from .graph import _size, render_history
from .server_client import ServerError, kernel_id, request, wait_result
from .snapshot_call import SNAPSHOT_TIMEOUT_S

__all__ = ["InfinijupMagics", "MagicError"]


def _say_id_when_stored(request_id: str) -> None:
    """A line under ``%snapshot``'s output that says "being stored" and, once the store has
    the commit, its id (the display is updated in place from a thread of the kernel's, after
    the cell has returned)."""
    from IPython.display import Pretty, display

    handle = display(Pretty("Storing it... (%snapshots lists it once it is safe in the store)"),
                     display_id=True)
    if handle is None:  # no display (a plain IPython): the message above is all
        return

    def wait() -> None:
        try:
            result = wait_result(request_id, SNAPSHOT_TIMEOUT_S)
        except ServerError as err:
            handle.update(Pretty(f"Not stored: {err}"))
            return
        if "error" in result:
            err = result["error"]
            handle.update(Pretty(f"Not stored: {err.get('message', 'unknown error')} "
                                 f"({err.get('reason', 'error')})"))
            return
        stored = (result.get("stats") or {}).get("stored_bytes")
        handle.update(Pretty(f"Stored as {result.get('commit', '')[:12]} "
                             f"({_size(stored)} new in the store)"))

    threading.Thread(target=wait, name="infinijup-snapshot-id", daemon=True).start()


class MagicError(InfinijupError):
    """A magic that failed; shown as a one-line error (no traceback through IPython)."""

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self} ({self.reason})"]


def _failed(what: str, err: ServerError | InfinijupError) -> MagicError:
    return MagicError(f"{what} failed: {err}", reason=getattr(err, "reason", "error"))


def parse_argstring(magic, line: str):
    """Shell-like parsing (quotes removed), unlike IPython's own, which keeps them."""
    return magic.parser.parse_args(shlex.split(line))


@magics_class
class InfinijupMagics(Magics):
    @magic_arguments()
    @argument("-m", "--message", default="", help="a message for the snapshot")
    @argument("-t", "--thread", default=None, help="the thread to put the snapshot on")
    @argument("-w", "--wait", action="store_true",
              help="wait until the store holds the snapshot (else the next cell runs as soon "
                   "as the kernel is dumped, while the store takes it in)")
    @line_magic
    def snapshot(self, line: str) -> None:
        """Snapshot this kernel, whole: ``%snapshot [-m MESSAGE] [-t THREAD] [-w]``."""
        args = parse_argstring(self.snapshot, line)
        try:
            result = snapshot_call.take(self.shell, message=args.message, thread=args.thread,
                                        wait=args.wait)
        except ServerError as err:
            raise _failed("Snapshot", err) from None
        request_id = result["request_id"]
        stats = result.get("stats", {})
        if "commit" not in result:  # dumped; the server stores it now (events say when done)
            print(f"Snapshot taken on thread '{result.get('thread')}' "
                  f"({_size(stats.get('image_bytes'))} image, paused "
                  f"{stats.get('pause_s', 0):.2f} s)")
            _say_id_when_stored(request_id)
            return
        print(
            f"Snapshot {result['commit'][:12]} on thread '{result['thread']}' "
            f"({_size(stats.get('image_bytes'))} image, {_size(stats.get('stored_bytes'))} new, "
            f"paused {stats.get('pause_s', 0):.2f} s)"
        )

    @magic_arguments()
    @argument("ref", help="commit id, unique prefix (8+ hex digits) or thread name")
    @argument("-b", "--branch", default=None, help="start a new thread at that commit")
    @line_magic
    def restore(self, line: str) -> None:
        """Restore this kernel to a snapshot: ``%restore REF [-b NEW_THREAD]``.

        The restore starts once this cell has finished; the next cell runs in the restored state.
        """
        args = parse_argstring(self.restore, line)
        try:
            _restore(args.ref, args.branch)
        except ServerError as err:
            raise _failed("Restore", err) from None
        print(f"Restoring {args.ref}: the next cell runs in the restored state.")

    @line_magic
    def snapshots(self, line: str) -> None:
        """Show this notebook's snapshots as a graph: ``%snapshots``."""
        if line.strip():
            raise MagicError(f"%snapshots takes no arguments (got {line.strip()!r})",
                             reason="bad_request")
        try:
            data = request("GET", f"/infinijup/history?kernel_id={kernel_id()}")
        except ServerError as err:
            raise _failed("Listing snapshots", err) from None
        print(render_history(data["commits"], data["threads"], data.get("head")))

    @magic_arguments()
    @argument("name", help="the new thread's name")
    @argument("ref", nargs="?", default=None, help="where it starts (default: where this kernel is)")
    @line_magic
    def branch(self, line: str) -> None:
        """Start a new thread: ``%branch NAME [REF]``. With REF, the kernel is restored there."""
        args = parse_argstring(self.branch, line)
        try:
            if args.ref:
                _restore(args.ref, args.name)
                print(f"Restoring {args.ref} on new thread '{args.name}': the next cell runs there.")
            else:
                out = request("POST", "/infinijup/branch", {"kernel_id": kernel_id(), "name": args.name})
                print(f"Next snapshots go to thread '{out['thread']}'.")
        except ServerError as err:
            raise _failed("Branch", err) from None


    @line_magic
    def hibernate(self, line: str) -> None:
        """Hibernate this kernel once this cell is done: ``%hibernate``. It is snapshotted and
        its process ends (no RAM, no GPU); the next cell wakes it where it was."""
        try:
            request("POST", "/infinijup/hibernate", {"kernel_id": kernel_id(), "from_kernel": True})
        except ServerError as err:
            raise _failed("Hibernate", err) from None
        print("The kernel hibernates once this cell is done; the next cell wakes it.")

    @line_magic
    def autosnapshot(self, line: str) -> None:
        """Automatic snapshots after cells (autosnap.py): ``%autosnapshot on|off|status``;
        ``on`` may set the rule too: ``%autosnapshot on share=0.1 after=30``."""
        auto = autosnap.instance()
        words = line.strip().lower().split() or ["status"]
        if auto is None:
            raise MagicError("automatic snapshots are not installed in this kernel",
                             reason="not_managed")
        if words[0] not in ("on", "off", "status") or (words[0] != "on" and len(words) > 1) \
                or any("=" not in w for w in words[1:]):
            raise MagicError("%autosnapshot takes on [share=S] [after=SECONDS], off or status "
                             f"(got {line.strip()!r})", reason="bad_request")
        if words[0] == "on":
            auto.settings = autosnap.parse(",".join(
                [f"share={auto.settings.share}", f"after={auto.settings.after_s}", *words]))
        elif words[0] == "off":
            auto.settings.on = False
        print(auto.status())

    @line_magic
    def undo(self, line: str) -> None:
        """Back to the state before the last cell that changed this kernel, once this cell is
        done: ``%undo``. Nothing is lost: ``%redo`` comes back (undo.py on the server)."""
        self._undo_redo("undo", line)

    @line_magic
    def redo(self, line: str) -> None:
        """Return to where the last ``%undo`` (or Undo) left: ``%redo``."""
        self._undo_redo("redo", line)

    def _undo_redo(self, what: str, line: str) -> None:
        if line.strip():
            raise MagicError(f"%{what} takes no arguments (got {line.strip()!r})",
                             reason="bad_request")
        try:
            out = request("POST", f"/infinijup/{what}", {"kernel_id": kernel_id(),
                                                         "from_kernel": True})
        except ServerError as err:
            raise _failed(what.capitalize(), err) from None
        print(f"{out.get('says', what)}: once this cell is done, the next cell runs there.")

    @line_magic
    def sidecar(self, line: str) -> None:
        """Processes that belong to this kernel, in its snapshots and restores:
        ``%sidecar start NAME [--pause URL --resume URL] -- CMD ...``, ``%sidecar list``,
        ``%sidecar stop NAME``, ``%sidecar logs NAME [-n LINES]``."""
        words = shlex.split(line)
        command, rest = (words[0], words[1:]) if words else ("list", [])
        try:
            if command == "start":
                if "--" in rest:
                    cut = rest.index("--")
                    head, argv = rest[:cut], rest[cut + 1:]
                else:
                    head, argv = rest[:1], rest[1:]
                urls = {"--pause": None, "--resume": None}
                while len(head) >= 3 and head[-2] in urls:
                    urls[head[-2]] = head[-1]
                    head = head[:-2]
                if len(head) != 1:
                    raise sidecars.SidecarError(
                        "usage: %sidecar start NAME [--pause URL --resume URL] -- CMD ...")
                started = sidecars.start(head[0], argv, pause_url=urls["--pause"],
                                         resume_url=urls["--resume"])  # in the kernel's cwd
                print(f"Sidecar '{started.name}' started (pid {started.pid}); its output: "
                      f"%sidecar logs {started.name}")
            elif command == "list":
                rows = sidecars.listing()
                if not rows:
                    print("No sidecars.")
                for r in rows:
                    state = "running" if r["running"] else f"exited ({r['exit_code']})"
                    print(f"{r['name']}\tpid {r['pid']}\t{state}\t{shlex.join(r['argv'])}")
            elif command == "stop" and len(rest) == 1:
                code = sidecars.stop(rest[0])
                print(f"Sidecar '{rest[0]}' stopped (exit code {code}).")
            elif command == "logs" and rest:
                lines = int(rest[rest.index("-n") + 1]) if "-n" in rest else 50
                print(sidecars.logs(rest[0], lines))
            else:
                raise sidecars.SidecarError(
                    "usage: %sidecar start NAME -- CMD ... | list | stop NAME | logs NAME [-n N]")
        except (sidecars.SidecarError, ValueError, IndexError) as exc:
            raise MagicError(f"Sidecar failed: {exc}", reason="sidecar") from None


def _restore(ref: str, branch: str | None) -> None:
    """Ask for a restore once this cell is done; the server refuses now what it would refuse
    then (unknown commit, a thread that exists, other GPUs), so that this cell fails."""
    body = {"kernel_id": kernel_id(), "commit": ref, "from_kernel": True}
    if branch is not None:
        body["branch"] = branch
    request("POST", "/infinijup/restore", body)
