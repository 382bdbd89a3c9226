"""The history DAG as text, like ``git log --graph``: used by ``%snapshots``."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence


def _size(n: int | None) -> str:
    if not n:
        return "0 B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def cell_label(cell: Mapping | None) -> str:
    """``[N] first line`` of the cell behind a commit (its label when it has no message)."""
    if not isinstance(cell, Mapping) or not cell.get("source"):
        return ""
    count = cell.get("execution_count")
    return f"[{count}] {cell['source']}" if count is not None else str(cell["source"])


def render_history(
    commits: Sequence[Mapping], threads: Mapping[str, str], head: Mapping | None = None
) -> str:
    """Draw ``commits`` (newest first, as /infinijup/history returns them) one per line."""
    if not commits:
        return "(no snapshots yet: %snapshot makes one)"
    labels: dict[str, list[str]] = {}
    for name, cid in sorted(threads.items()):
        labels.setdefault(cid, []).append(name)
    head_commit = (head or {}).get("commit")
    lanes: list[str] = []
    lines = []
    for c in commits:
        cid = c["id"]
        if cid not in lanes:
            lanes.append(cid)
        col = lanes.index(cid)
        graph = " ".join("*" if i == col else "|" for i in range(len(lanes)))
        tags = list(labels.get(cid, []))
        if cid == head_commit:
            tags.insert(0, "HEAD")
        tag_text = f" ({', '.join(tags)})" if tags else ""
        stats = c.get("stats") or {}
        gpu = " [GPU]" if (c.get("metadata") or {}).get("gpu") else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.get("created", 0)))
        msg = c.get("message") or cell_label((c.get("metadata") or {}).get("cell"))
        lines.append(
            f"{graph}  {cid[:12]}{tag_text}{gpu} {when} {_size(stats.get('stored_bytes'))}"
            + (f"  {msg}" if msg else "")
        )
        before = list(lanes)
        parents = list(c.get("parents") or [])
        if parents:
            lanes[col] = parents[0]
            for p in parents[1:]:
                if p not in lanes:
                    lanes.append(p)
        else:
            lanes[col] = ""  # the lane ends here
        seen: set[str] = set()
        lanes = [x for x in lanes if x and not (x in seen or seen.add(x))]
        connector = _connector(before, lanes, col, parents)
        if connector:
            lines.append(connector)
    return "\n".join(lines)


def _connector(before: list[str], after: list[str], col: int, parents: list[str]) -> str:
    """The line under a commit where lanes join, fork or shift, as ``git log --graph`` draws:
    ``|/`` where a branch meets its fork point, ``|\\`` where a merge opens a lane."""
    width = 2 * max(len(before), len(after)) - 1
    cells = [" "] * max(width, 1)
    moved = False
    for k, lane in enumerate(before):
        target = parents[0] if k == col and parents else lane
        if k == col and not parents:
            continue  # a root: its lane stops
        t = after.index(target) if target in after else k
        if t == k:
            cells[2 * k] = "|"
        elif t < k:  # this lane joins (or shifts onto) one to its left
            moved = True
            cells[2 * k - 1] = "/"
            for j in range(2 * t + 1, 2 * k - 1, 2):
                if cells[j] == " ":
                    cells[j] = "_"
        else:  # pushed right (a merge opened lanes before it)
            moved = True
            cells[2 * k + 1] = "\\"
    for p in parents[1:]:  # each other parent of a merge gets a lane from this commit
        t = after.index(p)
        if t > col:
            moved = True
            cells[2 * t - 1] = "\\"
    return "".join(cells).rstrip() if moved else ""
