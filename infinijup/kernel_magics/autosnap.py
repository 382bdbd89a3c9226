"""Automatic snapshots (issue 30): after a cell finishes, the kernel snapshots itself when that
is cheap compared with the cell, so that Undo can bring back the state before any cell.

The rule (:func:`decide`), for a cell that ran ``cell_s`` seconds:

* a cell that ran at least ``after_s`` is always snapshotted (its state was expensive to make);
* otherwise, only if the predicted pause is at most ``share`` of the cell's run time (5%: a
  0.5 s pause needs a cell of 10 s);
* never when the cell changed nothing you can see: no variable changed, appeared or went
  (the fingerprints of describe.py, compared with the last snapshot's).

The predicted pause is what this kernel's last snapshot from inside it (``%snapshot`` or an
automatic one) held the cell: describing, quiescing, the dump (longer than the frozen time the
server reports as ``pause_s``); before the first one a guess from the process's memory. The snapshot itself is the one ``%snapshot`` takes (snapshot_call.py),
marked ``auto``; the cell's answer waits only for the dump, never for the store.

A failure (helper down, store full) never fails the cell: it is said once, in the cell's
stderr, and then only counted (``%autosnapshot`` shows the last one) until a snapshot works
again. A kernel the server is moving (hibernating, restoring, snapshotting) answers 409: that
cell is skipped, silently.

Settings: ``$INFINIJUP_AUTOSNAPSHOT`` at start (``on`` or ``off``, then optional
``,share=0.05,after=60``; the server exports its ``SnapshotManager.autosnapshot*`` settings
so), ``%autosnapshot on|off|status``, and the server (Lab's setting) through the agent.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass

ENV = "INFINIJUP_AUTOSNAPSHOT"
DEFAULT_SHARE = 0.05
DEFAULT_AFTER_S = 60.0


@dataclass
class Settings:
    on: bool = False
    share: float = DEFAULT_SHARE
    after_s: float = DEFAULT_AFTER_S


def parse(text: str | None) -> Settings:
    """``on,share=0.05,after=60`` (each part optional; anything unreadable keeps its default)."""
    s = Settings()
    for part in (text or "").split(","):
        part = part.strip().lower()
        if part in ("on", "1", "true", "yes"):
            s.on = True
        elif part in ("off", "0", "false", "no"):
            s.on = False
        elif "=" in part:
            key, _, value = part.partition("=")
            try:
                number = float(value)
            except ValueError:
                continue
            if key == "share" and 0 < number <= 1:
                s.share = number
            elif key == "after" and number > 0:
                s.after_s = number
    return s


def decide(cell_s: float, predicted_pause_s: float, settings: Settings) -> tuple[bool, str]:
    """Whether a cell of ``cell_s`` seconds earns a snapshot on time alone (whether it changed
    anything is asked only then: it costs a look at the variables), and why."""
    if not settings.on:
        return False, "automatic snapshots are off"
    if cell_s >= settings.after_s:
        return True, f"the cell ran {cell_s:.1f} s (>= {settings.after_s:g} s)"
    if predicted_pause_s <= settings.share * cell_s:
        return True, (f"a pause of about {predicted_pause_s:.2f} s is at most "
                      f"{settings.share:.0%} of the cell's {cell_s:.2f} s")
    return False, (f"too quick: a pause of about {predicted_pause_s:.2f} s would be more than "
                   f"{settings.share:.0%} of the cell's {cell_s:.3f} s")


def guess_pause(rss_bytes: int) -> float:
    """Before this kernel's first snapshot: about 0.2 s, plus its memory at 1.5 GB/s."""
    return 0.2 + rss_bytes / 1.5e9


class AutoSnapshots:
    """The kernel's automatic snapshots: IPython's ``pre_run_cell`` and ``post_run_cell``."""

    def __init__(self, shell, settings: Settings | None = None) -> None:  # noqa: ANN001
        self.shell = shell
        self.settings = settings or parse(os.environ.get(ENV))
        self.last_pause_s: float | None = None
        self.taken = 0
        self.skipped = 0
        self.failures = 0
        self.last_error: str | None = None
        self.last_decision = ""
        self._said_error = False
        self._t0: float | None = None

    # --- IPython's events ------------------------------------------------------------------
    def before_cell(self, _info=None) -> None:  # noqa: ANN001
        self._t0 = time.perf_counter()

    def after_cell(self, result=None) -> None:  # noqa: ANN001
        t0, self._t0 = self._t0, None
        if t0 is None or not self.settings.on:
            return
        cell_s = time.perf_counter() - t0
        source = getattr(getattr(result, "info", None), "raw_cell", "") or ""
        if _is_own_magic(source):  # %autosnapshot, %undo, %snapshot...: nothing of the user's
            return
        take, why = decide(cell_s, self.predicted_pause(), self.settings)
        self.last_decision = why
        if not take:
            self.skipped += 1
            return
        self._take()

    # --- what they do ------------------------------------------------------------------------
    def predicted_pause(self) -> float:
        if self.last_pause_s is not None:
            return self.last_pause_s
        return guess_pause(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    def _take(self) -> None:
        from . import describe
        from .snapshot_call import SnapshotRefused, take

        before = set(describe.parent_names())
        try:
            result = take(self.shell, message="", wait=False, auto=True,
                          skip_if=lambda d: _unchanged(d, before))
        except SnapshotRefused as err:  # moving, hibernating, restoring: not this cell
            self.last_decision = f"skipped: {err}"
            self.skipped += 1
            return
        except Exception as err:  # never the user's cell's failure
            self.failures += 1
            self.last_error = str(err)
            if not self._said_error:
                self._said_error = True
                print(f"Infinijup: automatic snapshot failed: {err} (said once; "
                      "%autosnapshot status shows the last error)", file=sys.stderr)
            return
        if result is None:  # nothing changed
            self.last_decision = "the cell changed no variable"
            self.skipped += 1
            return
        self.taken += 1  # (take() noted what it held the cell: the next prediction)
        self._said_error = False

    def status(self) -> str:
        s = self.settings
        state = "on" if s.on else "off"
        lines = [f"Automatic snapshots are {state}: after a cell of at least {s.after_s:g} s, "
                 f"or when the pause (about {self.predicted_pause():.2f} s) is at most "
                 f"{s.share:.0%} of the cell; never after a cell that changed no variable.",
                 f"This kernel: {self.taken} taken, {self.skipped} skipped, "
                 f"{self.failures} failed."]
        if self.last_decision:
            lines.append(f"Last cell: {self.last_decision}.")
        if self.last_error:
            lines.append(f"Last error: {self.last_error}")
        return "\n".join(lines)


def _unchanged(described: dict, names_before: set[str]) -> bool:
    items = (described.get("variables") or {}).get("items") or []
    if (described.get("variables") or {}).get("truncated"):
        return False
    if any(it.get("changed") for it in items):
        return False
    return {it.get("name") for it in items} == names_before


_OWN_MAGICS = ("%autosnapshot", "%undo", "%redo", "%snapshot", "%restore", "%branch",
               "%hibernate", "%snapshots")


def _is_own_magic(source: str) -> bool:
    lines = [ln.strip() for ln in source.splitlines() if ln.strip()]
    return len(lines) == 1 and lines[0].split()[0] in _OWN_MAGICS


_instance: AutoSnapshots | None = None


def install(shell) -> AutoSnapshots:  # noqa: ANN001
    global _instance
    _instance = AutoSnapshots(shell)
    shell.events.register("pre_run_cell", _instance.before_cell)
    shell.events.register("post_run_cell", _instance.after_cell)
    return _instance


def instance() -> AutoSnapshots | None:
    return _instance


def noted_pause(pause_s: object) -> None:
    """A snapshot of this kernel took ``pause_s`` (the next prediction uses it)."""
    if _instance is not None and isinstance(pause_s, (int, float)):
        _instance.last_pause_s = float(pause_s)
