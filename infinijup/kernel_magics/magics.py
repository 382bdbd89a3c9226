"""``%snapshot``, ``%restore``, ``%history`` and ``%branch``: Infinijup from inside a notebook."""

from __future__ import annotations

import shlex
import uuid

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from . import hooks
from .graph import _size, render_history
from .server_client import ServerError, kernel_id, request, wait_result

SNAPSHOT_TIMEOUT_S = 3600.0


def parse_argstring(magic, line: str):
    """Shell-like parsing (quotes removed), unlike IPython's own, which keeps them."""
    return magic.parser.parse_args(shlex.split(line))


@magics_class
class InfinijupMagics(Magics):
    @magic_arguments()
    @argument("-m", "--message", default="", help="a message for the snapshot")
    @argument("-t", "--thread", default=None, help="the thread to put the snapshot on")
    @line_magic
    def snapshot(self, line: str) -> str | None:
        """Snapshot this kernel, whole: ``%snapshot [-m MESSAGE] [-t THREAD]``."""
        args = parse_argstring(self.snapshot, line)
        try:
            hooks.run_quiesce()
            request_id = uuid.uuid4().hex
            body = {
                "kernel_id": kernel_id(), "message": args.message, "from_kernel": True,
                "request_id": request_id, "execution_count": self.shell.execution_count,
            }
            if args.thread:
                body["thread"] = args.thread
            request("POST", "/infinijup/snapshot", body)
            result = wait_result(request_id, SNAPSHOT_TIMEOUT_S)
        except ServerError as err:
            print(f"Snapshot failed: {err}")
            return None
        finally:
            hooks.run_resume(False)
        if "error" in result:
            print(f"Snapshot failed: {result['error']['message']}")
            return None
        stats = result.get("stats", {})
        print(
            f"Snapshot {result['commit'][:12]} on thread '{result['thread']}' "
            f"({_size(stats.get('image_bytes'))} image, {_size(stats.get('stored_bytes'))} new, "
            f"paused {stats.get('pause_s', 0):.2f} s)"
        )
        return None

    @magic_arguments()
    @argument("ref", help="commit id, unique prefix (8+ hex digits) or thread name")
    @argument("-b", "--branch", default=None, help="start a new thread at that commit")
    @line_magic
    def restore(self, line: str) -> None:
        """Restore this kernel to a snapshot: ``%restore REF [-b NEW_THREAD]``.

        The restore starts once this cell has finished; the next cell runs in the restored state.
        """
        args = parse_argstring(self.restore, line)
        body = {"kernel_id": None, "commit": args.ref, "from_kernel": True}
        if args.branch:
            body["branch"] = args.branch
        try:
            body["kernel_id"] = kernel_id()
            request("POST", "/infinijup/restore", body)
        except ServerError as err:
            print(f"Restore failed: {err}")
            return
        print(f"Restoring {args.ref}: the next cell runs in the restored state.")

    @line_magic
    def history(self, line: str) -> None:
        """Show this notebook's snapshots as a graph: ``%history``."""
        try:
            data = request("GET", f"/infinijup/history?kernel_id={kernel_id()}")
        except ServerError as err:
            print(f"History unavailable: {err}")
            return
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
                request("POST", "/infinijup/restore", {
                    "kernel_id": kernel_id(), "commit": args.ref, "branch": args.name,
                    "from_kernel": True})
                print(f"Restoring {args.ref} on new thread '{args.name}': the next cell runs there.")
            else:
                out = request("POST", "/infinijup/branch", {"kernel_id": kernel_id(), "name": args.name})
                print(f"Next snapshots go to thread '{out['thread']}'.")
        except ServerError as err:
            print(f"Branch failed: {err}")
