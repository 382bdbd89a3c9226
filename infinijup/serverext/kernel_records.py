"""One JSON record per kernel in a directory beside the store, outliving the server: the
hibernated kernels' (hibernation.py) and the redo lists' (undo.py). Written atomically (a
temp file renamed over); a record that cannot be read is skipped, never fatal."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from ..errors import NotFound


def path(directory: Path, kernel_id: str) -> Path:
    if not kernel_id or "/" in kernel_id or kernel_id.startswith("."):
        raise NotFound(f"no kernel {kernel_id}", reason="unknown_kernel")
    return directory / f"{kernel_id}.json"


def write(directory: Path, kernel_id: str, record: dict) -> None:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    target = path(directory, kernel_id)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, target)


def remove(directory: Path, kernel_id: str) -> None:
    try:
        path(directory, kernel_id).unlink()
    except (FileNotFoundError, NotFound):
        pass


def read_all(directory: Path, valid: Callable[[dict], bool]) -> list[dict]:
    """The records that read as JSON objects ``valid`` accepts, by file name."""
    out = []
    for file in sorted(directory.glob("*.json")):
        try:
            record = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and valid(record):
            out.append(record)
    return out
