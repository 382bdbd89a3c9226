"""A running kernel kept aside, alive, while a snapshot is restored beside it.

Two moves replace a running kernel and keep it meanwhile (engine/set_aside.py renames its
listening socket files; the helper shuts down the connections they accepted and restores
beside it, binding the kernel's endpoints anew):

* an undo keeps the state it leaves, dumped and stored behind the restored kernel (undo.py);
* a restore in place whose page files stream from the store (issue 32) keeps the kernel it
  replaces until the restored kernel's memory is all back (``keep_until_resident``).

A lazy restore answers before the kernel's memory is back. From the hot tier its pages come
from files on this disk; from the store they are read, decoded and checked as the kernel
runs (engine/store_pages.py), so a damaged or removed pack or a killed serving process ends
the stream, and with it the restored kernel. A resume or a wake has nothing to lose then. A
restore in place had ended the user's kernel before, so it checked every page out first: a
3 GiB kernel took 11-14 s against 1 s for 256 MiB (bench/restore_bench.py). Now the kernel it
replaces is kept aside, and the kernel is ``settling`` (engine/lifecycle.py: cells run;
another snapshot, restore or hibernation waits) until the restored memory is all back; then
the kernel kept aside is ended. If the restored kernel ends first (its stream failed, or
anything else), the kernel kept aside is this kernel again, as it was before the restore,
and the failure is reported. Where a kernel cannot be kept aside, the page files are checked
out first, as before.

The check (``may_set_aside``): the helper gives kernels PID namespaces (a restore takes the
snapshot's pids, which the kernel kept aside holds otherwise), no GPU state on either side,
and host memory free for the second kernel. The helper checks again what only it can see.
"""

from __future__ import annotations

import asyncio

from ..engine.lifecycle import RUNNING, SETTLING, Operation
from ..engine.reconnect import connections_to, wait_reconnected
from ..engine.set_aside import SetAside, move_back
from ..errors import InfinijupError, RestoreFailed
from ..process import tree_rss
from ..store.faults import holdpoint
from .kernel_status import pages

SET_ASIDE_SPARE = 256 << 20  # free memory the second kernel must leave, past its own size
POLL_S = 0.2


def may_set_aside(m, kernel_id: str, commits: list[str], size: int) -> bool:  # noqa: ANN001
    """Whether the running kernel may be kept aside while a snapshot of ``size`` bytes is
    restored beside it (in a worker thread): PID namespaces, no GPU state in ``commits`` (its
    head, the snapshot) nor in the kernel now, memory free for ``size`` and a quarter more."""
    if not m.helper_has("pid_namespace"):
        return False
    repo = m.repo()
    for commit_id in commits:
        meta = repo.get_commit(commit_id).metadata or {}
        if meta.get("gpu") or meta.get("gpu_segments"):
            return False
    if m.uses_gpu(kernel_id):
        return False
    available, _total = m.host_memory()
    return available >= size + size // 4 + SET_ASIDE_SPARE


def image_bytes(m, commit_id: str) -> int:  # noqa: ANN001
    return int((m.repo().get_commit(commit_id).stats or {}).get("image_bytes") or 0)


def may_keep_replaced(m, kernel_id: str, commit_id: str) -> bool:  # noqa: ANN001
    """Whether a restore of ``commit_id`` in place (of a running kernel) may keep the
    running kernel until the restored memory is back (so that its page files may stream
    from the store)."""
    if not (m.lazy_restore and getattr(m, "restore_keeps_replaced", True)):
        return False
    head = m.heads.get(kernel_id).commit
    # the restored kernel grows to the snapshot's size beside the one kept
    return may_set_aside(m, kernel_id, [c for c in (head, commit_id) if c],
                         image_bytes(m, commit_id))


def kernel_size(m, kernel_id: str, head: str) -> int:  # noqa: ANN001
    """The kernel's size at its head or now, whichever is more (it may have grown)."""
    size = image_bytes(m, head)
    root = m.provisioner(m.kernel(kernel_id)).root_pid
    return max(size, tree_rss(root)) if root is not None else size


async def keep_until_resident(m, run, kept: SetAside, turn) -> None:  # noqa: ANN001
    """Behind a restore in place whose pages stream from the store (``run``: its RestoreRun,
    the kernel ``settling``): once the restored kernel's memory is all back, the kernel kept
    aside is ended. If the restored kernel ends first (or its memory cannot be brought
    back), the kernel kept aside is this kernel again, as it was, and the failure is
    reported once. The kernel kept aside is ended whatever else happens (a shutdown, the
    server stopping)."""
    km, prov, kernel_id = run.km, run.prov, run.km.kernel_id
    restored = prov.tracked
    taken_back = False
    m.kept_aside[kernel_id] = kept
    try:
        await asyncio.to_thread(holdpoint, "keep_until_resident")  # (tests hold it here)
        now: dict | None = None
        while kernel_id in m.kernel_ids() and prov.tracked is restored and restored.alive():
            now = await pages(km)
            if now is None or now.get("state") != "streaming":
                break
            await asyncio.sleep(POLL_S)
        if kernel_id not in m.kernel_ids() or prov.tracked is not restored:
            return  # shut down or replaced meanwhile: the kernel kept aside goes
        if restored.alive() and (now is None or now.get("state") == "resident"):
            return  # all back: the kernel kept aside goes
        why = ((now or {}).get("error") or "the restored kernel ended before its memory "
               "was back").splitlines()[0]
        if not kept.process.alive():  # nothing to give back: the restarter starts it fresh
            exc = RestoreFailed(f"restore failed: the kernel's memory could not be brought "
                                f"back from the store ({why}), and the kernel kept aside had "
                                "ended too; it is restarted fresh (every snapshot is intact)",
                                reason="pages_failed")
            m.log.warning("infinijup: %s", exc.message)
            m.events.failed(Operation("restore", kernel_id, run.op.path), exc)
            return
        # our connections to the restored kernel, if it still runs (none where it ended)
        restored_side = await asyncio.to_thread(connections_to, list(run.connected or {}))
        await prov.kill()  # (the helper ended it already where its memory failed)
        move_back(kept.moved)
        prov.attach(kept.process)
        taken_back = True
        # before the failure is said: as many connections as the server had before the
        # restore, new ones (a notebook's next cell must find its websocket's sockets there;
        # counting those to a restored kernel that had ended already waited for nothing)
        await wait_reconnected(run.connected or {}, m.answer_timeout, also_gone=restored_side)
        km.session.key = run.session_key
        m.heads.set(kernel_id, run.head_before, prov)
        exc = RestoreFailed(f"restore failed: the kernel's memory could not be brought back "
                            f"from the store ({why}); the kernel is back as it was before the "
                            "restore", reason="pages_failed")
        m.log.warning("infinijup: %s", exc.message)
        m.events.failed(Operation("restore", kernel_id, run.op.path), exc)
    finally:
        if let_go(m, kernel_id, kept) and not taken_back:
            await end_kept(m, kept)
        if turn.state == SETTLING:
            turn.to(RUNNING)


def let_go(m, kernel_id: str, kept: SetAside) -> bool:  # noqa: ANN001
    """``kept`` off the record of kernels kept aside; False where a stopping server took it
    (and ended it) first."""
    if m.kept_aside.get(kernel_id) is not kept:
        return False
    del m.kept_aside[kernel_id]
    return True


async def end_kept(m, kept: SetAside) -> None:  # noqa: ANN001
    """The kernel kept (or set) aside ended, its socket files and handle let go."""
    if kept.process.alive():
        try:
            await asyncio.to_thread(m.engine().helper.kill, kept.pid)
        except InfinijupError as exc:
            m.log.warning("infinijup: ending the kernel kept aside (pid %d) failed: %s",
                          kept.pid, exc.message)
    kept.close()


async def end_all_kept(m) -> None:  # noqa: ANN001
    """The server stops: every kernel kept aside behind a restore, or set aside by an undo
    and not yet dumped, is ended (the restored kernels are stopped with the others; nothing
    would end these)."""
    while m.kept_aside:
        _kernel_id, kept = m.kept_aside.popitem()
        await end_kept(m, kept)
