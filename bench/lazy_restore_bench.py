"""Lazy against whole restore through the helper (issue 32), side by side.

A real ipykernel holding N MiB of random bytes is dumped once; then, alternating, it is
restored in place whole and lazily (``restore(lazy=True)``: CRIU's lazy-pages daemon). Per
restore: the time from the request to the first answered ``kernel_info`` (the user's first
answer), for lazy restores also until the helper reports the memory all back ("resident"),
and the first cell, sent right after the answer, that reads every byte (a blake2b of the
whole blob): in a lazy restore it runs while the rest streams in. Medians; the images sit in the page cache (a hot restore, like the hot tier's).

    python3 bench/lazy_restore_bench.py --mib 256 3072 --runs 5

``--store`` adds a third restore, lazy with the page files read from a store: the images
committed to a store in the bench's base, the page files moved out of the images dir and
served by the server's serving process (engine/store_pages.py) through the helper's page
source (infinijup_helper/page_source.py), as a wake from the store serves them. Its time to
the first answer includes the serving process's start (it is started per restore).
With ``--store`` the kernel's bytes are all distinct (a repeated MiB would be one chunk).
``--no-cell`` leaves the cell out, so that "all resident" is the page stream's alone (with the
cell, the kernel's own faults share the cores with the stream from the answer on).
``INFINIJUP_BENCH_VERBOSE=1`` prints each restore's helper phases (stage, files, kill of the
replaced kernel, CRIU's restore) and the wait for the answer after them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from benchkit import helper_in_base

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "helper"))
from helperkit import Trees, start_kernel  # noqa: E402


def _fill(kernel, mib: int, distinct: bool) -> None:  # noqa: ANN001
    """N MiB of random bytes, filled in place 64 MiB at a time (built whole and then copied
    into the bytearray, a 16 GiB kernel would need twice its memory at the start)."""
    part = "os.urandom(min(step, len(blob) - i))" if distinct else "one[:min(step, len(blob) - i)]"
    kernel.execute("import os, hashlib\n"
                   f"blob, step = bytearray({mib} << 20), 64 << 20\n"
                   "one = os.urandom(1 << 20) * 64\n"
                   "for i in range(0, len(blob), step):\n"
                   f"    blob[i:i + step] = {part}\n"
                   "del one\n"
                   "digest = hashlib.blake2b(blob).hexdigest()", timeout=1800)


class _FromStore:
    """The images' page files in a store, served on ``pages.sock`` in the images dir."""

    def __init__(self, images: str, store: str) -> None:
        from infinijup.engine.store_pages import is_page_file
        from infinijup.store import Repository

        self.images, self.repo = Path(images), Repository.init(store)
        commit = self.repo.commit_dir(images, thread="bench", message="lazy restore bench")
        self.pages = {e.name: e.id for e in self.repo.get_tree(commit.tree)
                      if e.kind == "file" and is_page_file(e.name)}
        self.kept = Path(store) / "kept"
        self.kept.mkdir()

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        from infinijup.engine.store_pages import SOCKET, StorePagesProcess

        for name in self.pages:
            os.rename(self.images / name, self.kept / name)
        source = None
        try:
            source = StorePagesProcess(self.repo, self.pages, self.images / SOCKET)
            source.wait_ready()
            yield
        finally:
            if source is not None:
                source.stop_listening()
                source.proc.wait(timeout=600)
            (self.images / SOCKET).unlink(missing_ok=True)
            for name in self.pages:
                os.rename(self.kept / name, self.images / name)


def _touch_all_s(kernel) -> float:  # noqa: ANN001
    start = time.monotonic()
    got = kernel.evaluate(ok="hashlib.blake2b(blob).hexdigest() == digest")
    assert got == {"ok": "True"}, got
    return time.monotonic() - start


def _first_reply(kernel) -> None:  # noqa: ANN001
    """Until the kernel's first shell reply: kernel_info every 0.1 s (after a restore the
    client's sockets reconnect and early requests can be lost), any of their replies counts."""
    sent: set[str] = set()
    deadline = time.monotonic() + 600  # hang guard
    while time.monotonic() < deadline:
        sent.add(kernel.kc.kernel_info())
        until = time.monotonic() + 0.1
        while time.monotonic() < until:
            try:
                msg = kernel.kc.shell_channel.get_msg(timeout=0.01)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") in sent:
                return
    raise TimeoutError("the kernel did not answer")


def _one(client, kernel, images: str, mode: str, store: _FromStore | None,  # noqa: ANN001
         no_cell: bool = False) -> dict:
    lazy = mode != "whole"
    start = time.monotonic()
    with store.serving() if mode == "store" else contextlib.nullcontext():
        restored = client.restore(images, replace_pid=kernel.pid, lazy=lazy,
                                  page_source="pages.sock" if mode == "store" else None)
        return _after_restore(client, kernel, restored, start, lazy, no_cell)


def _after_restore(client, kernel, restored, start: float, lazy: bool,  # noqa: ANN001
                   no_cell: bool = False) -> dict:
    kernel.pid = restored.pid
    helper_s = time.monotonic() - start
    _first_reply(kernel)
    row = {"answer": time.monotonic() - start, "resident": None}
    if os.environ.get("INFINIJUP_BENCH_VERBOSE"):  # the helper's phases, then the answer
        print(f"  lazy={lazy} helper {helper_s:.3f} s "
              f"{ {k: round(v, 3) for k, v in restored.phases.items()} } "
              f"answer {row['answer'] - helper_s:.3f} s", flush=True)
    kernel.wait_answering(timeout=600)  # iopub too, before the next cell (not timed)
    # right after the answer: while pages still stream (--no-cell: not at all, so that "all
    # resident" is the stream's alone)
    row["touch"] = None if no_cell else _touch_all_s(kernel)
    if lazy:
        assert restored.pages is not None, restored.whole_why
        while (pages := client.status(restored.pid).pages)["state"] == "streaming":
            time.sleep(0.01)
        assert pages["state"] == "resident", pages
        row["resident"] = pages["resident_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[256, 3072])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--store", action="store_true",
                    help="also restore lazily with the page files served from a store")
    ap.add_argument("--no-cell", action="store_true",
                    help="no cell reading every byte: 'all resident' is the stream's alone")
    args = ap.parse_args()
    modes = ["whole", "lazy"] + (["store"] if args.store else [])
    from infinijup.helper_client import HelperClient

    rows = []
    with helper_in_base() as (base, helper):
        client = HelperClient(helper.socket_path, timeout=900)
        for mib in args.mib:
            trees = Trees()
            kernel = start_kernel(client, trees)
            try:
                _fill(kernel, mib, distinct=args.store)
                images = os.path.join(client.work_dir(), f"lazy-bench-{mib}")
                client.dump(kernel.pid, images)
                store = _FromStore(images, str(base / f"store-{mib}")) if args.store else None
                got: dict[str, list[dict]] = {m: [] for m in modes}
                for _ in range(args.runs):
                    for mode in modes:
                        got[mode].append(_one(client, kernel, images, mode, store, args.no_cell))
                        trees.add(kernel.pid)
                client.release(images)
            finally:
                kernel.close()
                trees.cleanup()
            rows.append((mib, _medians(got)))
    print(f"\nlazy against whole restore, medians of {args.runs} alternating runs "
          f"({os.cpu_count()} CPUs)\n")
    print("| kernel | restore | first answer | all resident | resident rate "
          "| cell reading all |")
    print("|---|---|---|---|---|---|")
    for mib, med in rows:
        for mode in modes:
            m = med[mode]
            res = (f"{m['resident']:.3f} s | {mib / 1024 / m['resident']:.2f} GiB/s"
                   if m["resident"] is not None else "- | -")
            cell = f"{m['touch']:.3f} s" if m["touch"] is not None else "-"
            print(f"| {mib} MiB | {LABELS[mode]} | {m['answer']:.3f} s | {res} | {cell} |")
    if len(rows) > 1:
        (small, first), *rest = rows
        for mib, med in rest:
            print(f"\nfirst answer, {mib} MiB against {small} MiB: " + ", ".join(
                f"{LABELS[m]} {med[m]['answer'] / first[m]['answer']:.2f}x" for m in modes))


LABELS = {"whole": "whole", "lazy": "lazy", "store": "lazy, pages from a store"}


def _medians(got: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    for mode, runs in got.items():
        out[mode] = {"answer": statistics.median(r["answer"] for r in runs)}
        touched = [r["touch"] for r in runs if r["touch"] is not None]
        out[mode]["touch"] = statistics.median(touched) if touched else None
        resident = [r["resident"] for r in runs if r["resident"] is not None]
        out[mode]["resident"] = statistics.median(resident) if resident else None
    return out


if __name__ == "__main__":
    main()
