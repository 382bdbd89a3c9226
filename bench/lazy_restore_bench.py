"""Lazy against whole restore through the helper (issue 32), side by side.

A real ipykernel holding N MiB of random bytes is dumped once; then, alternating, it is
restored in place whole and lazily (``restore(lazy=True)``: CRIU's lazy-pages daemon). Per
restore: the time from the request to the first answered ``kernel_info`` (the user's first
answer), for lazy restores also until the helper reports the memory all back ("resident"),
and the first cell, sent right after the answer, that reads every byte (a blake2b of the
whole blob): in a lazy restore it runs while the rest streams in. Medians; the images sit in the page cache (a hot restore, like the hot tier's).

    python3 bench/lazy_restore_bench.py --mib 256 3072 --runs 5
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import time

from benchkit import helper_in_base

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "helper"))
from helperkit import Trees, start_kernel  # noqa: E402


def _fill(kernel, mib: int) -> None:  # noqa: ANN001
    kernel.execute(f"import os, hashlib\nblob = bytearray(os.urandom(1 << 20)) * {mib}\n"
                   "digest = hashlib.blake2b(blob).hexdigest()", timeout=600)


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


def _one(client, kernel, images: str, lazy: bool) -> dict:  # noqa: ANN001
    start = time.monotonic()
    restored = client.restore(images, replace_pid=kernel.pid, lazy=lazy)
    kernel.pid = restored.pid
    _first_reply(kernel)
    row = {"answer": time.monotonic() - start, "resident": None}
    kernel.wait_answering(timeout=600)  # iopub too, before the next cell (not timed)
    row["touch"] = _touch_all_s(kernel)  # right after the answer: while pages still stream
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
    args = ap.parse_args()
    from infinijup.helper_client import HelperClient

    rows = []
    with helper_in_base() as (_base, helper):
        client = HelperClient(helper.socket_path, timeout=900)
        for mib in args.mib:
            trees = Trees()
            kernel = start_kernel(client, trees)
            try:
                _fill(kernel, mib)
                images = os.path.join(client.work_dir(), f"lazy-bench-{mib}")
                client.dump(kernel.pid, images)
                got: dict[bool, list[dict]] = {False: [], True: []}
                for _ in range(args.runs):
                    for lazy in (False, True):
                        got[lazy].append(_one(client, kernel, images, lazy))
                        trees.add(kernel.pid)
                client.release(images)
            finally:
                kernel.close()
                trees.cleanup()
            med = {k: {f: statistics.median(r[f] for r in v if r[f] is not None)
                       for f in ("answer", "touch")} for k, v in got.items()}
            resident = statistics.median(r["resident"] for r in got[True])
            rows.append((mib, med[False]["answer"], med[True]["answer"], resident,
                         mib / 1024 / resident, med[False]["touch"], med[True]["touch"]))
    print(f"\nlazy against whole restore, medians of {args.runs} alternating runs "
          f"({os.cpu_count()} CPUs)\n")
    print("| kernel | whole: first answer | lazy: first answer | lazy: all resident "
          "| resident rate | whole: cell reading all | lazy: cell reading all |")
    print("|---|---|---|---|---|---|---|")
    for mib, wa, la, res, rate, wt, lt in rows:
        print(f"| {mib} MiB | {wa:.3f} s | {la:.3f} s | {res:.3f} s | {rate:.2f} GiB/s "
              f"| {wt:.3f} s | {lt:.3f} s |")
    if len(rows) > 1:
        base = rows[0]
        for row in rows[1:]:
            print(f"\nlazy first answer, {row[0]} MiB against {base[0]} MiB: "
                  f"{row[2] / base[2]:.2f}x (whole: {row[1] / base[1]:.2f}x)")


if __name__ == "__main__":
    main()
