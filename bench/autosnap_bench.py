"""What automatic snapshots cost a notebook, and undo against a restore (issue 30), through a
real `jupyter server`, the helper and CRIU, as a notebook meets them.

A notebook written for the bench (not copied from anywhere) that looks like real work: load
data, reshape it, summarize it, fit a small model by gradient steps, plot-like summaries, and
quick cells between. It runs per working set on a server with automatic snapshots off, then
on one with them on for each ``--ingest-nice`` (the store's ingest that many nice levels below
the server; the defaults: 5% share, always after ``--after-s`` 60 s), the same helper, a fresh
store each; ``--work disk hugetmpfs`` runs "on" once with the helper's work dir (CRIU's images,
the hot tier) on the disk and once on a tmpfs with 2 MiB pages (a helper of its own each);
``--rounds`` N runs them N times in turn and takes each cell's median. Printed per
run: each cell's time, and each automatic snapshot's image, stored bytes and timings (the
helper's dump and publish). Then the notebook's total time both ways and the overhead; the
cells after the last snapshot (they run while the store takes its images in); the worst cell (its
time with snapshots on minus off, over its time off: on a busy machine, mostly the noise of
quick cells); how many cells were snapshotted, and the largest share a snapshot held the cell it
followed (that cell's time on minus off: the whole wait, not only the frozen time). Then, on the
"on" kernel: undo to the first answered cell against a restore of
the same snapshot to the first answered cell, ``--repeat`` times. The first undo finds the
kernel changed since its last snapshot (the quick cells after it), so it keeps that state
(set aside and stored behind the undo, or stored first: undo.py), as a user's undo after a few
quick cells does: it is reported alone (bench/undo_bench.py compares the two ways). The
later ones find the kernel unchanged: their median. ``INFINIJUP_BENCH_VERBOSE=1`` prints each
undo's and restore's phases (the save, the checkout, CRIU's restore, the first answer).

    python bench/autosnap_bench.py [--mib 100 1024] [--repeat 3] [--fit-s 20] [--after-s 60]
                                   [--ingest-nice 0 10] [--rounds 3] [--work disk hugetmpfs]

``--session N`` runs instead a session of N quick cells (small changes, a new 1 MiB array every
tenth cell, a cell that only prints every fifth) with a snapshot after every cell that changed
something (``%autosnapshot on after=0.0001``) and the window set by ``--keep`` and
``--keep-mib``; it prints the snapshots taken and kept, the bytes the kept ones hold against
the budget (what each added to the store), the first snapshot's bytes (a whole image: the base
the window stands on, not counted in it) and the store's size on disk once the last thinning
pass is done.

``--passes N`` measures instead the retention pass that follows each automatic snapshot, on a
store of the bench's own (no kernel: real commits, ``--commits`` of them, one in ten the user's,
automatic ones of 64 KiB each over a shared 1 MiB, all but the window thinned as a long session
leaves them). N cells each store one more automatic snapshot, then a pass runs, on two copies of
that store, cell by cell in turn: *before* (every commit read to find the automatic ones, the
window thinned to its limit at each pass, so a gc per cell once full) and *after* (the index's
metadata, each commit read once, thinning in batches: serverext/retention.py). Printed: the
median and slowest pass, all passes' time, the passes that ran gc.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "helper"), str(ROOT / "tests" / "reliability"),
                str(ROOT / "bench")]
from benchkit import HelperDaemon, helper_in_base, huge_tmpfs, markdown_table  # noqa: E402
from reliakit import ServerProcess  # noqa: E402
from wake_bench import run_cell  # noqa: E402


def notebook(mib: int, fit_s: float) -> list[str]:
    """The cells; the fit runs gradient steps for ``fit_s`` seconds (a long cell: the kind
    worth a snapshot), the rest take what their work takes."""
    n = mib * 2**20 // 8  # float64 values
    return [
        "import numpy as np, time\nrng = np.random.default_rng(7)",
        f"data = rng.random({n})  # load",
        "data.shape, data.dtype",
        "table = data.reshape(-1, 8)  # reshape into rows of 8 features",
        "cols = table.mean(axis=0); cols",
        "order = np.argsort(table[:, 0], kind='stable')  # sort by the first feature",
        "table = table[order]",
        "print('rows', len(table))",
        "w = np.zeros(8)\nsteps = 0\nstop = time.perf_counter() + " + repr(fit_s) + "\n"
        "while time.perf_counter() < stop:  # fit: gradient steps of a least-squares model\n"
        "    y = table[:200_000, 0] * 3.0 + 1.0\n"
        "    grad = table[:200_000].T @ (table[:200_000] @ w - y) / 200_000\n"
        "    w -= 0.5 * grad\n"
        "    steps += 1",
        "w.round(3)",
        "hist, edges = np.histogram(table[:, 1], bins=50)  # a plot's numbers",
        "hist.max(), edges[:3]",
        "resid = table[:200_000] @ w - (table[:200_000, 0] * 3.0 + 1.0)\nfloat(np.abs(resid).mean())",
        "summary = {'w': w.tolist(), 'rows': len(table)}\nsummary['rows']",
    ]


async def run_notebook(server: ServerProcess, cells: list[str]) -> tuple[str, list[float], object]:
    kernel_id = server.open_session(f"bench-auto-{uuid.uuid4().hex[:6]}.ipynb")
    ws = await server.websocket(kernel_id)
    await run_cell(ws, "1")
    times = [await run_cell(ws, code) for code in cells]
    return kernel_id, times, ws


def history(server: ServerProcess, kernel_id: str) -> list[dict]:
    code, body = server.request("GET", f"/infinijup/history?kernel_id={kernel_id}")
    assert code == 200, body
    return (json.loads(body) if isinstance(body, (str, bytes)) else body)["commits"]


def timed_post(server: ServerProcess, route: str, body: dict) -> dict:
    code, out = server.request("POST", f"/infinijup/{route}", body)
    if code != 200:
        raise RuntimeError(f"{route}: {code} {out}")
    return json.loads(out) if isinstance(out, (str, bytes)) else out


async def undo_against_restore(server, kernel_id, ws, repeat: int) -> dict:
    """Undo to the first answered cell, against a restore of the same snapshot, ``repeat``
    times. The first undo finds the kernel changed since its last snapshot (the cells after
    it were too quick to snapshot), so it saves that state first; the later ones find it
    unchanged (it stands on what the restore before brought back): their median apart."""
    undo_s, restore_s, saved = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        moved = timed_post(server, "undo", {"kernel_id": kernel_id})
        await run_cell(ws, "1")
        undo_s.append(time.perf_counter() - t0)
        saved.append(bool(moved.get("saved")))
        verbose("undo", moved)
        redone = timed_post(server, "redo", {"kernel_id": kernel_id})  # (waits for the state
        verbose("redo", redone)  # left, where the undo set the kernel aside: undo.py)
        here = moved["from"] or redone["commit"]
        await run_cell(ws, "1")
        t0 = time.perf_counter()
        back = timed_post(server, "restore", {"kernel_id": kernel_id, "commit": moved["commit"]})
        await run_cell(ws, "1")
        restore_s.append(time.perf_counter() - t0)
        verbose("restore", back)
        timed_post(server, "restore", {"kernel_id": kernel_id, "commit": here})
        await run_cell(ws, "1")
    out = {"restore": statistics.median(restore_s)}
    if saved and saved[0]:
        out["undo_saved"] = undo_s[0]
    rest = [t for t, s in zip(undo_s, saved, strict=True) if not s]
    if rest:
        out["undo"] = statistics.median(rest)
    return out


def verbose(what: str, answer: dict) -> None:
    """With ``INFINIJUP_BENCH_VERBOSE``: where an undo's or restore's time went."""
    if os.environ.get("INFINIJUP_BENCH_VERBOSE"):
        phases = {k: round(v, 2) for k, v in (answer.get("phases") or {}).items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)}
        why = (answer.get("phases") or {}).get("whole_why")  # a restore that was not lazy
        where = {k: (answer.get("phases") or {})[k] for k in ("images", "pages_from_store")
                 if k in (answer.get("phases") or {})}  # the images' tier; pages served
        print(f"  {what}: {answer.get('duration_s', 0):.2f} s, saved "
              f"{answer.get('saved', '-')}, {phases}" + (f", {where}" if where else "")
              + (f", whole: {why}" if why else ""), flush=True)


async def one_run(server: ServerProcess, cells: list[str], on: bool, repeat: int
                  ) -> tuple[list[float], dict]:
    """The notebook on a started server; with snapshots on, what they took and held."""
    kernel_id, times, ws = await run_notebook(server, cells)
    extra: dict = {}
    if on:
        autos = [c for c in history(server, kernel_id)
                 if (c.get("metadata") or {}).get("auto")]
        extra["snapshotted"] = len(autos)
        for c in autos:  # where each one's time went
            meta, stats = c.get("metadata") or {}, c.get("stats") or {}
            timings = {k: round(v, 2) for k, v in (meta.get("timings") or {}).items()
                       if isinstance(v, (int, float))}
            print(f"  snapshot after [{(meta.get('cell') or {}).get('execution_count')}]: "
                  f"image {stats.get('image_bytes', 0) / 1e9:.2f} GB, stored "
                  f"{stats.get('stored_bytes', 0) / 1e6:.1f} MB, {timings}", flush=True)
        # the cells that were followed by one (their index in ``cells``)
        extra["cells"] = [
            count - 2 for c in autos
            if isinstance(count := ((c.get("metadata") or {}).get("cell") or {})
                          .get("execution_count"), int)
            and 2 <= count <= len(times) + 1]
        if autos and repeat > 0:
            extra.update(await undo_against_restore(server, kernel_id, ws, repeat))
    ws.close()
    server.request("DELETE", f"/api/kernels/{kernel_id}")
    return times, extra


async def main_async(args) -> None:
    rows = []
    # off, then on once per ingest priority asked for, side by side: ``--rounds`` times in
    # turn, each cell's median over the rounds
    # ``--work``: the helper's work dir (CRIU's images, the hot tier) on the disk, or on a
    # tmpfs with 2 MiB pages (a helper of its own)
    variants = [(False, 0, "disk")] + [(True, nice, work) for work in args.work
                                       for nice in args.ingest_nice]
    with helper_in_base() as (base, disk_helper), contextlib.ExitStack() as stack:
        helpers = {"disk": disk_helper}
        if "hugetmpfs" in args.work:
            (base / "huge-helper").mkdir()
            huge = HelperDaemon(base / "huge-helper")
            huge.work_dir = stack.enter_context(huge_tmpfs())
            huge.start()
            stack.callback(huge.stop)
            helpers["hugetmpfs"] = huge
        for mib in args.mib:
            cells = notebook(mib, args.fit_s)
            runs: list[list[tuple[list[float], dict]]] = [[] for _ in variants]
            for r in range(args.rounds):
                for n, (on, nice, work) in enumerate(variants):
                    server = ServerProcess(base / f"server-{mib}-{r}-{n}",
                                           helpers[work].socket_path,
                                           str(base / f"store-{n}"), base / "notebooks",
                                           manager_config={"autosnapshot": on,
                                                           "autosnapshot_after_s": args.after_s,
                                                           "autosnapshot_ingest_nice": nice})
                    server.start()
                    try:
                        what = f"on, ingest nice +{nice}, work dir {work}" if on else "off"
                        print(f"{mib} MiB, round {r + 1}, snapshots {what} "
                              f"(load {os.getloadavg()[0]:.1f})", flush=True)
                        # undo against restore: in the last round only
                        repeat = args.repeat if r + 1 == args.rounds else 0
                        runs[n].append(await one_run(server, cells, on, repeat))
                    finally:
                        server.stop()
                        shutil.rmtree(base / f"store-{n}", ignore_errors=True)  # a fresh one
                        shutil.rmtree(base / f"server-{mib}-{r}-{n}", ignore_errors=True)
                    print("  cells: " + " ".join(f"{t:.2f}" for t in runs[n][-1][0]),
                          flush=True)
            off = medians([times for times, _ in runs[0]])
            for n, (_, nice, work) in enumerate(variants[1:], start=1):
                on_times = medians([times for times, _ in runs[n]])
                extra = {**runs[n][-1][1], "rounds": args.rounds}
                rows.append({**row_of(mib, cells, off, on_times, extra, nice), "work": work})
                print(rows[-1], flush=True)
    print(markdown_table(rows, [("set", "working set"), ("work", "work dir"),
                                ("nice", "ingest nice"),
                                ("cells", "cells"),
                                ("off", "notebook, snapshots off"), ("on", "on"),
                                ("overhead", "overhead"),
                                ("worst", "worst cell (on vs off)"),
                                ("snapshotted", "cells snapshotted"),
                                ("pause", "largest hold / its cell"),
                                ("after", "cells after the last snapshot, on vs off"),
                                ("undo_saved", "undo to first cell, changed kernel "
                                               "(saved first)"),
                                ("undo", "undo, unchanged kernel"),
                                ("restore", "restore of the same, to first cell")]))


def medians(runs: list[list[float]]) -> list[float]:
    """Each cell's median over the rounds."""
    return [statistics.median(cell) for cell in zip(*runs, strict=True)]


def row_of(mib: int, cells: list[str], off: list[float], on_times: list[float], extra: dict,
           nice: int) -> dict:
    share = max((b - a) / a for a, b in zip(off, on_times, strict=True) if a > 0)
    # what a snapshot held its cell: that cell's time with snapshots on minus off (the fit
    # runs for a fixed time, so for it the difference is the snapshot's alone)
    held = [(on_times[i] - off[i]) / off[i] for i in extra.get("cells", []) if off[i] > 0]
    # the cells after the last snapshot run while the store takes its images in
    last = max(extra.get("cells", []), default=len(cells) - 1)
    after_off, after_on = sum(off[last + 1:]), sum(on_times[last + 1:])
    return {"set": f"{mib} MiB", "nice": f"+{nice}", "cells": str(len(cells)),
            "off": f"{sum(off):.2f} s", "on": f"{sum(on_times):.2f} s",
            "overhead": f"{(sum(on_times) / sum(off) - 1) * 100:+.1f}%",
            "worst": f"{share * 100:+.0f}%",
            "pause": f"{max(held) * 100:.1f}%" if held else "-",
            "snapshotted": str(extra.get("snapshotted", 0)),
            "after": f"{after_on:.2f} vs {after_off:.2f} s" if last + 1 < len(cells) else "-",
            "undo_saved": f"{extra['undo_saved']:.2f} s" if "undo_saved" in extra else "-",
            "undo": f"{extra['undo']:.2f} s" if "undo" in extra else "-",
            "restore": f"{extra['restore']:.2f} s" if "restore" in extra else "-"}


def session_cells(n: int) -> list[str]:
    cells = ["import numpy as np\nlog = []\ntotal = 0\n%autosnapshot on after=0.0001"]
    for i in range(1, n):
        if i % 10 == 0:
            cells.append(f"blob{i % 70} = np.random.default_rng({i}).random(131072)  # 1 MiB")
        elif i % 5 == 4:
            cells.append("print(len(log), total)")
        else:
            cells.append(f"log.append({i})\ntotal += {i}")
    return cells


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


async def session(args, base: Path, helper) -> None:  # noqa: ANN001 - HelperDaemon
    budget = args.keep_mib * 2**20
    store = base / "store-session"
    server = ServerProcess(base / "server-session", helper.socket_path, str(store),
                           base / "notebooks",
                           manager_config={"autosnapshot": True, "autosnapshot_keep": args.keep,
                                           "autosnapshot_keep_bytes": budget,
                                           "hot_tier_bytes": 0})
    server.start()
    try:
        cells = session_cells(args.session)
        t0 = time.perf_counter()
        kernel_id, times, ws = await run_notebook(server, cells)
        took = time.perf_counter() - t0
        # the last thinning pass: wait until the kept window stops changing
        seen, stable = None, 0
        while stable < 3:
            commits = history(server, kernel_id)
            autos = [c for c in commits if (c.get("metadata") or {}).get("auto")]
            kept = [c for c in autos if not c.get("thinned")]
            now = (len(autos), len(kept))
            stable = stable + 1 if now == seen else 0
            seen = now
            await asyncio.sleep(2)
        kept_bytes = sum(int(c["stats"].get("stored_bytes") or 0) for c in kept)
        # the session's first snapshot stored a whole image: the base the window stands on
        first = min(autos, key=lambda c: c["created"])
        full = int(first["stats"].get("stored_bytes") or 0)
        pauses = [c["stats"]["pause_s"] for c in autos if c.get("stats", {}).get("pause_s")]
        ws.close()
        server.request("DELETE", f"/api/kernels/{kernel_id}")
    finally:
        server.stop()
    row = {"cells": str(len(cells)), "took": f"{took:.0f} s",
           "median cell": f"{statistics.median(times) * 1000:.0f} ms",
           "taken": str(len(autos)), "kept": f"{len(kept)} (keep {args.keep})",
           "kept bytes": f"{kept_bytes / 2**20:.1f} MiB (budget {args.keep_mib} MiB)",
           "pause": f"{statistics.median(pauses):.2f} s" if pauses else "-",
           "full image": f"{full / 2**20:.1f} MiB",
           "store": f"{du(store) / 2**20:.1f} MiB"}
    print(markdown_table([row], [(k, k) for k in row]))


def build_long_store(path: Path, commits: int, keep: int):  # noqa: ANN201 - a Blob
    """A store as a long session leaves it: ``commits`` snapshots on one thread, one in ten
    the user's, the automatic ones past the window of ``keep`` thinned and collected."""
    import os

    from infinijup.store import Repository
    from infinijup.store.gc import gc
    from infinijup.store.thinned import mark_thinned

    repo = Repository.init(path)
    with repo.writer() as w:
        base = w.add_bytes(os.urandom(1 << 20))
    autos: list[str] = []
    for i in range(commits):
        auto_snapshot(repo, base, i, auto=i % 10 != 0, into=autos)
    mark_thinned(repo, autos[:-keep])
    gc(repo)
    repo.close()
    return base


def auto_snapshot(repo, base, i: int, auto: bool = True, into: list | None = None) -> str:  # noqa: ANN001
    import os

    meta = {"cell": {"execution_count": i, "source": f"x = {i}"}, **({"auto": True} if auto
                                                                      else {})}
    with repo.writer() as w:
        c = w.commit({"heap.img": base, "cell.img": w.add_bytes(os.urandom(64 << 10))},
                     thread="main", message="" if auto else f"mine {i}", metadata=meta)
    if auto and into is not None:
        into.append(c.id)
    return c.id


def pass_before(repo, window) -> tuple[list[str], bool]:  # noqa: ANN001
    """The pass of 7d297d1: every commit read, thinned to the limit each time."""
    from infinijup.engine.retention import Auto, to_thin
    from infinijup.store.gc import gc
    from infinijup.store.thinned import mark_thinned, thinned

    gone = thinned(repo)
    autos = []
    for cid in repo.index.commit_ids():
        if cid in gone:
            continue
        c = repo.get_commit(cid)
        if (c.metadata or {}).get("auto"):
            autos.append(Auto(cid, c.created, int((c.stats or {}).get("stored_bytes") or 0)))
    ids = to_thin(autos, time.time(), window, set(repo.threads().values()))
    if ids:
        mark_thinned(repo, ids)
        gc(repo)
    return ids, bool(ids)


def passes(args) -> None:
    import dataclasses
    import shutil
    import tempfile

    from infinijup.engine.retention import Window
    from infinijup.serverext.retention import Automatic, thin_pass
    from infinijup.store import Repository

    window = Window(keep_all_s=10**9, max_count=args.keep)
    with tempfile.TemporaryDirectory(prefix="retention-bench-") as tmp:
        t0 = time.perf_counter()
        base = build_long_store(Path(tmp) / "before", args.commits, args.keep)
        print(f"store of {args.commits} commits built in {time.perf_counter() - t0:.0f} s",
              flush=True)
        shutil.copytree(Path(tmp) / "before", Path(tmp) / "after")
        repos = {name: Repository.open(Path(tmp) / name) for name in ("before", "after")}
        times: dict[str, list[float]] = {"before": [], "after": []}
        gcs = {"before": 0, "after": 0}
        found = Automatic()
        for i in range(args.passes):
            for name in ("before", "after"):
                repo = repos[name]
                auto_snapshot(repo, base, args.commits + i)
                t0 = time.perf_counter()
                if name == "before":
                    _, ran = pass_before(repo, dataclasses.replace(window, slack=0))
                else:
                    ids, _ = thin_pass(repo, window, set(), found, time.time())
                    ran = bool(ids)
                times[name].append(time.perf_counter() - t0)
                gcs[name] += ran
        rows = [{"pass": name, "median": f"{statistics.median(t) * 1000:.0f} ms",
                 "slowest": f"{max(t) * 1000:.0f} ms", "all": f"{sum(t):.1f} s",
                 "gc": f"{gcs[name]} of {len(t)}"} for name, t in times.items()]
    print(markdown_table(rows, [("pass", f"pass ({args.commits} commits, window {args.keep})"),
                                ("median", "median pass"), ("slowest", "slowest"),
                                ("all", f"{args.passes} passes"), ("gc", "passes with gc")]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, nargs="*", default=[100, 1024])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--fit-s", type=float, default=20.0, help="seconds of the long fit cell")
    p.add_argument("--after-s", type=float, default=60.0,
                   help="autosnapshot_after_s: a cell this long is always snapshotted")
    p.add_argument("--ingest-nice", type=int, nargs="+", default=[10],
                   help="autosnapshot_ingest_nice: one run with snapshots on for each")
    p.add_argument("--work", nargs="+", default=["disk"], choices=["disk", "hugetmpfs"],
                   help="the helper's work dir: one run with snapshots on for each")
    p.add_argument("--rounds", type=int, default=1,
                   help="run off and each 'on' this many times in turn; each cell's median")
    p.add_argument("--session", type=int, default=0,
                   help="run a session of this many quick cells instead (the disk aim)")
    p.add_argument("--keep", type=int, default=100, help="with --session: snapshots kept")
    p.add_argument("--keep-mib", type=int, default=64, help="with --session: their bytes")
    p.add_argument("--passes", type=int, default=0,
                   help="measure this many retention passes instead (no kernel)")
    p.add_argument("--commits", type=int, default=3000, help="with --passes: the store's")
    args = p.parse_args()
    if args.passes:
        passes(args)
        return
    asyncio.run(session_main(args) if args.session else main_async(args))


async def session_main(args) -> None:
    with helper_in_base() as (base, helper):
        await session(args, base, helper)


if __name__ == "__main__":
    main()
