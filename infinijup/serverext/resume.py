"""Resume: a snapshot into a notebook's running kernel, or into a new kernel started for it,
or into a copy of the notebook (``<name>-<commit>.ipynb``) beside whatever runs in the original.

Everything that can refuse (unknown commit, other GPUs, a snapshot this server's kernels cannot
take) refuses before a kernel is started; a resume that fails later leaves no kernel it started
behind.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from ..engine.naming import notebook_key
from ..engine.retarget import why_not_retargetable
from ..errors import Conflict, PreflightRefused
from ..gpu.restore_rules import plan_gpu_restore
from .history import resolve, session_connection
from .restore_flow import restore


class Resumes:
    def __init__(self, manager) -> None:  # noqa: ANN001 - the SnapshotManager
        self.m = manager
        self._path_locks: dict[str, asyncio.Lock] = {}  # one resume at a time per notebook
        # kernel id -> notebook, for a kernel started without a session (session=False): the
        # notebook's client makes the one session (Lab opens its own, so a session made here
        # would be a second one for the path)
        self.paths: dict[str, str] = {}
        # kernels started for a resume whose restore has not ended: a websocket opened to one
        # waits for it (websocket.py), from before the kernel starts, so that no websocket
        # asks the kernel that the restore is about to replace for its kernel_info
        self.starting: set[str] = set()

    async def resume(self, path: str, ref: str, *, kernel_name: str | None = None,
                     new_notebook: bool = False, force: bool = False,
                     session: bool = True) -> dict:
        m = self.m
        make_session = session  # False: the notebook's client makes it (see self.paths)
        repo = m.repo()
        commit_id = await asyncio.to_thread(resolve, repo, notebook_key(path), ref)
        commit = await asyncio.to_thread(repo.get_commit, commit_id)
        meta = commit.metadata or {}
        await asyncio.to_thread(plan_gpu_restore, meta, force=force)
        why_not = why_not_retargetable(meta.get("connection") or {}, session_connection())
        if why_not is not None:
            raise PreflightRefused(why_not, reason="not_resumable_here")
        if new_notebook:
            path = await self.copy_notebook(path, commit_id)
        t0 = time.perf_counter()
        async with self._path_locks.setdefault(path, asyncio.Lock()):
            sessions = m.serverapp.session_manager
            session = await self.session_of(path)
            started = session is None
            kernel = kernel_name or meta.get("kernel_name") or "infinijup"
            new_id = str(uuid.uuid4()) if started else None
            if new_id is not None:
                self.starting.add(new_id)
            try:
                if started and not make_session:
                    await sessions.start_kernel_for_session(
                        str(uuid.uuid4()), path, path, "notebook", kernel, kernel_id=new_id)
                    self.paths[new_id] = path
                    session = {"id": None, "kernel": {"id": new_id}}
                elif started:
                    session = await sessions.create_session(
                        path=path, name=path, type="notebook", kernel_name=kernel,
                        kernel_id=new_id)
                kernel_id = session["kernel"]["id"]
                try:
                    result = await restore(m, kernel_id, commit_id, force=force, fresh=started)
                except BaseException:
                    if started:
                        if session["id"] is not None:
                            await sessions.delete_session(session["id"])
                        else:
                            self.paths.pop(kernel_id, None)
                            await m.kernel_manager.shutdown_kernel(kernel_id)
                        m.heads.forget(kernel_id)
                    raise
            finally:
                self.starting.discard(new_id)
        return {**result, "session_id": session["id"], "path": path, "started": started,
                "duration_s": time.perf_counter() - t0}

    async def session_of(self, path: str) -> dict | None:
        m = self.m
        for s in await m.serverapp.session_manager.list_sessions():
            if s.get("path") == path and (s.get("kernel") or {}).get("id") in \
                    m.kernel_manager.list_kernel_ids():
                return s
        return None

    async def copy_notebook(self, path: str, commit_id: str) -> str:
        """A new notebook beside ``path`` for a resumed kernel (an empty one if ``path`` is
        gone), named after the commit; returns its path."""
        from jupyter_server.utils import ensure_async

        cm = self.m.serverapp.contents_manager
        directory, _, name = path.rpartition("/")
        stem = name[:-6] if name.endswith(".ipynb") else name
        for n in range(1, 1000):
            suffix = commit_id[:8] if n == 1 else f"{commit_id[:8]}-{n}"
            new_path = f"{directory}/{stem}-{suffix}.ipynb".lstrip("/")
            if not await ensure_async(cm.exists(new_path)):
                break
        else:
            raise Conflict(f"too many copies of {path}", reason="notebook_exists")
        if await ensure_async(cm.exists(path)):
            model = await ensure_async(cm.get(path, content=True, type="notebook"))
            model = {"type": "notebook", "format": "json", "content": model["content"]}
        else:
            import nbformat

            model = {"type": "notebook", "format": "json", "content": nbformat.v4.new_notebook()}
        await ensure_async(cm.save(model, new_path))
        return new_path
