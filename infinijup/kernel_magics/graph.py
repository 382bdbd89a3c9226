"""The history DAG as text, like ``git log --graph``: used by ``%history``."""

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
        msg = c.get("message") or ""
        lines.append(
            f"{graph}  {cid[:12]}{tag_text}{gpu} {when} {_size(stats.get('stored_bytes'))}"
            + (f"  {msg}" if msg else "")
        )
        parents = list(c.get("parents") or [])
        if parents:
            lanes[col] = parents[0]
            for p in parents[1:]:
                if p not in lanes:
                    lanes.append(p)
        else:
            lanes.pop(col)
        seen: set[str] = set()
        lanes = [x for x in lanes if not (x in seen or seen.add(x))]
    return "\n".join(lines)
