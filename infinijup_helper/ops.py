"""One method per op. No socket code: the server hands in a caller, typed args and a progress
callback, and gets back the result object or a :class:`RequestError`.

Every op that names a tree takes it from the registry (registry.py), never from what /proc
says about a pid, and holds it until the op is done. Operations on the same tree are
serialized (a dump racing a kill of the same tree would leave either half-done); operations
on different trees run concurrently. A non-root caller's trees, dumps and restores run with the
caller's own credentials (creds.py); per-user limits bound what one user can take (limits.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import protocol as p
from .arena import Arena
from .cgroups import caller_cgroup_procs, unified_mount
from .checkpoint import (
    CriuDump,
    CriuRestore,
    DumpJob,
    KillReplaced,
    PublishImages,
    RestoreJob,
    StageImages,
    VerifyDumpedCreds,
    member_pidfds,
    reap_dumped,
    terminate_tree,
)
from .creds import (
    CRIU_DUMP_CAPS,
    CRIU_RESTORE_CAPS,
    NSINIT_CAPS_PIDNS,
    RunAs,
    has_capability,
    nsinit_group,
    user_groups,
)
from .criu import Criu, KeyedLocks
from .cuda_stage import CudaResumeAfterDump, CudaResumeRestored, CudaSuspend, resume_tree
from .host_files import CheckHostFiles
from .lazy_pages import PageStream
from .limits import Limits, caller_rlimits
from .page_source import PageSource
from .paths import WorkDirs, check_target_free, remove_entry
from .proc import Caller, authorize_members, owns, read_proc
from .protocol import RequestError
from .registry import Held, Registry, Tree
from .retarget import RetargetImages, RetargetPlan
from .seal import Sealer
from .spawn import SpawnFailed, SpawnSpec, spawn_tree
from .stages import Progress, Stage, run_stages

Result = Mapping[str, Any]
log = logging.getLogger(__name__)


def caller_groups(caller: Caller) -> tuple[int, ...]:
    """The caller's gid and supplementary groups, as initgroups(3) would set them."""
    return user_groups(caller.uid, caller.gid)


@dataclass(frozen=True)
class Features:
    cuda: bool = False

    @classmethod
    def detect(cls) -> Features:
        """CUDA stages only where the driver's checkpoint API is usable."""
        try:
            from . import cuda_driver

            return cls(cuda=cuda_driver.available())
        except Exception:
            return cls(cuda=False)


def _gpu_summary(stages: list[Stage]) -> dict[str, Any] | None:
    for stage in stages:
        summary = getattr(stage, "summary", None)
        if summary:
            return summary
    return None


def tree_rss(pids: list[int]) -> int:
    """Resident memory of the processes, in bytes (what a dump will have to move)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


class Operations:
    """The helper's ops, bound to its work dirs, CRIU, registry and seal key."""

    def __init__(
        self,
        work: WorkDirs,
        criu: Criu,
        registry: Registry,
        sealer: Sealer,
        python: str = sys.executable,
        features: Features = Features(),
        pid_namespace: bool | None = None,
        limits: Limits | None = None,
        cgroup: str = "caller",
        arena: Arena | None = None,
    ) -> None:
        self.work = work
        self.arena = arena  # the GPU arena (arena.py), or None
        self.criu = criu
        self.registry = registry
        self.sealer = sealer
        self.python = python
        self.features = features
        self.limits = limits or Limits()
        # Kernels join their caller's cgroup (v2) unless told not to (see cgroups.py).
        self.cgroup_mount = unified_mount() if cgroup == "caller" else None
        # Kernels get their own PID namespace, except where CUDA is usable: the CUDA driver
        # fails to initialize (error 304) in a PID namespace without its own /proc, and CRIU
        # cannot dump the mount namespace such a /proc needs. Restores then need the original
        # pids free, which they are when a kernel is restored in place.
        self.pid_namespace = (not features.cuda) if pid_namespace is None else pid_namespace
        self.locks = KeyedLocks()
        self.streams: dict[int, PageStream] = {}  # lazily restored trees (lazy_pages.py)
        # What running a non-root caller's tree and CRIU as that caller needs from our root.
        needed = set(CRIU_DUMP_CAPS) | set(CRIU_RESTORE_CAPS) | set(NSINIT_CAPS_PIDNS)
        self.missing_caps = sorted(c for c in needed if not has_capability(c))
        self._handlers: dict[str, Callable[[Caller, Any, Progress], Result]] = {
            "hello": self.hello,
            "spawn": self.spawn,
            "dump": self.dump,
            "restore": self.restore,
            "kill": self.kill,
            "release": self.release,
            "status": self.status,
            "signal": self.signal,
            "gpu": self.gpu,
            "trees": self.trees,
        }
        assert set(self._handlers) == p.OPS

    def handle(self, caller: Caller, request: p.Request, progress: Progress) -> Result:
        return self._handlers[request.op](caller, request.args, progress)

    # --- pipelines (the hook for GPU stages) ---------------------------------------------------

    def dump_stages(self) -> list[Stage]:
        stages: list[Stage] = [
            CriuDump(self.criu, self.work),
            VerifyDumpedCreds(self.criu),
            PublishImages(self.criu, self.sealer, self.work),
        ]
        if self.features.cuda:
            # VRAM to host memory before CRIU, back after: CRIU sees plain memory.
            suspend = CudaSuspend()
            stages = [suspend, stages[0], CudaResumeAfterDump(suspend), *stages[1:]]
        return stages

    def restore_stages(self) -> list[Stage]:
        stages: list[Stage] = [
            StageImages(self.criu, self.sealer),
            RetargetImages(self.criu),
            CheckHostFiles(self.criu, self.python),  # what CRIU would not reopen: refused now
            KillReplaced(self.criu),
            CriuRestore(self.criu),
        ]
        if self.features.cuda:
            stages.append(CudaResumeRestored())
        return stages

    # --- who runs what ------------------------------------------------------------------------

    def _as_caller(self, caller: Caller, caps: tuple[int, ...]) -> RunAs | None:
        """CRIU's credentials for this caller: theirs plus ``caps`` (None: root runs it)."""
        if caller.is_root:
            return None
        if self.missing_caps:
            from .creds import CAP_NAMES

            names = ", ".join(f"CAP_{CAP_NAMES[c].upper()}" for c in self.missing_caps)
            raise RequestError(
                "unsupported",
                f"this helper's root lacks {names} (a restricted container or sandbox): it "
                "cannot run a non-root user's kernel and CRIU with that user's credentials "
                "here; give the helper these capabilities")
        return RunAs(caller.uid, caller.gid, caller_groups(caller), caps)

    def _init_identity(self, caller: Caller) -> tuple[int | None, str]:
        """The extra group of the caller's tree inits (non-root) and their cwd."""
        group = None if caller.is_root else nsinit_group()
        return group, self.work.nsinit_cwd(caller.uid, group)

    def _check_tree_limit(self, caller: Caller, replacing: int | None = None) -> None:
        if caller.is_root:
            return
        live = [t for t in self.registry.owned_by(caller.uid) if t.pid != replacing]
        if len(live) >= self.limits.trees_per_user:
            raise RequestError(
                "limit_reached",
                f"uid {caller.uid} already runs {len(live)} kernel trees, the most this helper "
                f"allows one user ({self.limits.trees_per_user}); stop one first")

    @contextlib.contextmanager
    def _tree(self, caller: Caller, pid: int):  # noqa: ANN202 - yields Held
        """Serialize on the tree, then hold it (authorized by the registry). A tree the op
        ended and reaped (kill, a restore's replaced tree) is told to the arena after it."""
        held = None
        try:
            with self.locks.hold(("tree", pid)), self.registry.hold(caller.uid, pid) as tree:
                held = tree
                yield tree
        finally:
            if held is not None and self.registry.lookup(pid) is not held.tree:
                self.tree_ended(held.tree)

    def tree_ended(self, tree: Tree) -> None:
        """A tree is gone (reaped by an op, or by the reaper): what its kernels left in the GPU
        arena goes (arena.py says when)."""
        if self.arena is None:
            return
        try:
            self.arena.tree_ended(tree, self.registry.owned_by(tree.owner))
        except Exception:  # noqa: BLE001 - the op (or the reaper) goes on regardless
            log.exception("arena: tidying after tree %d of uid %d failed", tree.pid, tree.owner)

    def _arena_dir(self, caller: Caller) -> str | None:
        if self.arena is None:
            return None
        try:
            return self.arena.user_dir(caller)
        except (OSError, RuntimeError) as exc:  # the server then keeps its arena in /dev/shm
            log.warning("arena: no GPU arena for uid %d: %s", caller.uid, exc)
            return None

    # --- ops ----------------------------------------------------------------------------------

    def hello(self, caller: Caller, args: p.HelloArgs, progress: Progress) -> Result:
        return {
            "version": p.VERSION,
            "criu_version": self.criu.version,
            "uid": caller.uid,
            "work_dir": self.work.user_dir(caller),
            "arena_dir": self._arena_dir(caller),
            "features": {"cuda": self.features.cuda, "pid_namespace": self.pid_namespace,
                         # this caller's restores can be lazy (else whole: see _whole_why)
                         "lazy_pages": caller.is_root and self._whole_why(None) is None},
        }

    def spawn(self, caller: Caller, args: p.SpawnArgs, progress: Progress) -> Result:
        if not os.path.isabs(args.cwd):
            raise RequestError("bad_path", f"{args.cwd!r}: cwd must be an absolute path")
        log_path = self.work.confine_file(caller, args.log_path)
        self._check_tree_limit(caller)
        if not caller.is_root:
            self._as_caller(caller, ())  # refuse early where non-root trees cannot work
        group, nsinit_cwd = self._init_identity(caller)
        spec = SpawnSpec(
            argv=list(args.argv),
            env=dict(args.env),
            cwd=args.cwd,
            log_path=log_path,
            uid=caller.uid,
            gid=caller.gid,
            groups=list(caller_groups(caller)),
            python=self.python,
            nsinit_path=self.work.nsinit_path,
            nsinit_cwd=nsinit_cwd,
            pid_namespace=self.pid_namespace,
            nsinit_group=group,
            rlimits=caller_rlimits(caller, self.limits),
            cgroup_procs=caller_cgroup_procs(caller, self.cgroup_mount),
        )
        try:
            pid = spawn_tree(spec)
        except SpawnFailed as exc:
            raise RequestError("spawn_failed", str(exc)) from None
        tree = self.registry.add(pid, caller.uid)
        if self.arena is not None:
            self.arena.spawned(tree, args.env)  # its kernel id: its arena files go with it
        return {"pid": pid}

    def dump(self, caller: Caller, args: p.DumpArgs, progress: Progress) -> Result:
        start = time.monotonic()
        with self._tree(caller, args.pid) as tree:
            tree.ensure_alive()
            members = authorize_members(caller, tree.pid, tree.alive)
            run_as = self._as_caller(caller, CRIU_DUMP_CAPS)
            group = None if caller.is_root else nsinit_group()
            lock_key = _init_cwd_key(tree) if tree.tree.namespace else None
            parent_fd, name = self.work.open_parent(caller, args.images_dir)
            try:
                check_target_free(parent_fd, name, args.images_dir)
                with self.work.staging("dump", owner=caller) as staging:
                    job = DumpJob(
                        caller=caller,
                        tree=tree,
                        leave_running=args.leave_running,
                        allowed_gids=caller_groups(caller),
                        staging=staging,
                        parent_fd=parent_fd,
                        name=name,
                        run_as=run_as,
                        init_groups=(group,) if group is not None else (),
                        init_caps=NSINIT_CAPS_PIDNS,
                        deadline_s=self.criu.deadline_s(tree_rss([tree.pid, *members])),
                        lock_key=lock_key,
                    )
                    stages = self.dump_stages()
                    # a tree not left running is ended by CRIU: its pids freed before the answer
                    # (a PID namespace's init becomes reapable only after all of its tree)
                    ending = {} if args.leave_running or tree.tree.namespace else \
                        member_pidfds(tree)
                    try:
                        phases = run_stages(stages, job, progress)
                        if not args.leave_running:
                            reap_dumped(tree, ending)
                    finally:
                        for fd in ending.values():
                            os.close(fd)
            finally:
                os.close(parent_fd)
        return {
            "image_bytes": job.image_bytes,
            "duration_s": round(time.monotonic() - start, 6),
            "phases": phases,
            "gpu": _gpu_summary(stages),
        }

    def restore(self, caller: Caller, args: p.RestoreArgs, progress: Progress) -> Result:
        start = time.monotonic()
        job: RestoreJob | None = None  # (None: the restore failed before it killed anything)
        with contextlib.ExitStack() as cleanup:
            replace, exiting = None, contextlib.ExitStack()  # the replaced tree, held
            cleanup.enter_context(exiting)
            if args.replace_pid is not None:
                replace = exiting.enter_context(self._tree(caller, args.replace_pid))
                exiting.callback(_reap_replaced, lambda: job)
            # (a tree set aside lives on beside the restored one)
            self._check_tree_limit(caller, replacing=None if args.park else args.replace_pid)
            run_as = self._as_caller(caller, CRIU_RESTORE_CAPS)
            group, _cwd = self._init_identity(caller)  # the cwd the images' init returns to
            log_path = (self.work.confine_file(caller, args.log_path)
                        if args.log_path is not None else None)
            images_fd = self.work.open_dir(caller, args.images_dir)
            cleanup.callback(os.close, images_fd)
            kept = cleanup.enter_context(contextlib.ExitStack())  # a lazy restore keeps it
            staging = kept.enter_context(self.work.staging("restore", owner=caller))
            job = RestoreJob(
                caller=caller,
                images_fd=images_fd,
                allowed_gids=caller_groups(caller),
                staging=staging,
                registry=self.registry,
                replace=replace,
                run_as=run_as,
                init_groups=(group,) if group is not None else (),
                init_caps=NSINIT_CAPS_PIDNS,
                gpu_map=args.gpu_map,
                retarget=RetargetPlan(port_map=args.port_map, path_map=args.path_map,
                                      log_path=log_path),
                cgroup_procs=caller_cgroup_procs(caller, self.cgroup_mount),
                park=args.park,
                lazy=args.lazy and not self._whole_why(run_as),
                whole_why=self._whole_why(run_as) if args.lazy else None,
            )
            if args.page_source is not None:
                job.source = PageSource(images_fd, args.page_source, caller)
            stages = self.restore_stages()
            try:
                phases = run_stages(stages, job, progress)
            except BaseException:
                if job.stream is not None:
                    job.stream.abort()
                raise
            finally:
                if job.source is not None and job.stream is None:
                    job.source.close()  # a whole restore: every page was filled in
            if job.stream is not None:
                self._stream_pages(caller, job, kept.pop_all())
            if job.replaced_exiting:  # it exits beside the restored tree: reaped after
                threading.Thread(target=exiting.pop_all().close, name="reap-replaced",
                                 daemon=True).start()
        return {"pid": job.pid, "duration_s": round(time.monotonic() - start, 6), "phases": phases,
                "gpu": _gpu_summary(stages), "retargeted": job.retargeted,
                "pages": self.streams[job.pid].report() if job.stream is not None else None,
                "whole_why": job.whole_why, "parked": job.replace_pid if job.park else None}

    def _whole_why(self, run_as: RunAs | None) -> str | None:
        """Why this caller's lazy restores are made whole instead (None: they can be lazy;
        images whose processes map the CUDA driver are restored whole too: StageImages)."""
        if run_as is not None:
            # CRIU 4.2's unprivileged mode never opens a userfaultfd (kerndat_uffd skips it),
            # though the capabilities CRIU runs with here (CAP_SYS_PTRACE) would allow it
            return ("CRIU runs as the caller (unprivileged mode), where it has no lazy pages "
                    "(restored whole)")
        return None

    def _stream_pages(self, caller: Caller, job: RestoreJob, kept: contextlib.ExitStack) -> None:
        """A lazy restore's tree runs: its page daemon and staging dir live on until its
        memory is all back; if the daemon fails first, the tree is ended (lazy_pages.py)."""
        stream, pid = job.stream, job.pid
        assert stream is not None and pid is not None
        stream.keep(kept)

        def kill_tree() -> None:
            with self.registry.hold(caller.uid, pid) as held:
                terminate_tree(held)
            if self.registry.lookup(pid) is not held.tree:
                self.tree_ended(held.tree)

        self.streams[pid] = stream
        stream.watch(kill_tree)

    def kill(self, caller: Caller, args: p.KillArgs, progress: Progress) -> Result:
        with self._tree(caller, args.pid) as tree:
            terminate_tree(tree)
        return {}

    def gpu(self, caller: Caller, args: p.GpuArgs, progress: Progress) -> Result:
        """Release a live kernel's GPUs (VRAM to host memory) or take them back, without CRIU:
        the building block for idle kernels that give their GPU back."""
        if not self.features.cuda:
            raise RequestError("unsupported", "no usable CUDA driver on this machine")
        with self._tree(caller, args.pid) as tree:
            tree.ensure_alive()
            start = time.monotonic()
            if args.action == "release":
                stage = CudaSuspend(tree.pid, owner=tree.tree.owner)
                stage.run(None)
                summary = stage.summary or {"pids": 0}
            else:
                summary = resume_tree(tree.pid)
        return {"duration_s": round(time.monotonic() - start, 6), "gpu": summary}

    def signal(self, caller: Caller, args: p.SignalArgs, progress: Progress) -> Result:
        """Signal a tree's init, which forwards it to the kernel (root's inits cannot be
        signalled by their users directly)."""
        with self._tree(caller, args.pid) as tree:  # not into a dump: it would be dumped
            try:
                signal.pidfd_send_signal(tree.pidfd, args.signum)
            except ProcessLookupError:
                raise RequestError("no_such_process", f"the tree of {tree.pid} has exited") \
                    from None
        return {}

    def release(self, caller: Caller, args: p.ReleaseArgs, progress: Progress) -> Result:
        parent_fd, name = self.work.open_parent(caller, args.path)
        try:
            remove_entry(parent_fd, name)
        finally:
            os.close(parent_fd)
        return {}

    def status(self, caller: Caller, args: p.StatusArgs, progress: Progress) -> Result:
        tree = self.registry.lookup(args.pid)
        if tree is not None:
            if not caller.is_root and tree.owner != caller.uid:
                raise RequestError("permission_denied",
                                   f"process {args.pid} does not belong to uid {caller.uid}")
            if tree.alive():
                return {"alive": True, "exit_code": None, **self._pages(args.pid)}
            self.registry.wait_gone(args.pid, 2.0)  # exited a moment ago; let it be reaped
        record = self.registry.exit_record(args.pid)
        if record is not None:
            if caller.is_root or record.owner_uid == caller.uid:
                return {"alive": False, "exit_code": record.exit_code, **self._pages(args.pid)}
            return {"alive": False, "exit_code": None}
        info = read_proc(args.pid)  # not a tree: any process of the caller's own
        if info is not None and not info.is_zombie:
            if not owns(caller, info):
                raise RequestError("permission_denied",
                                   f"process {args.pid} does not belong to uid {caller.uid}")
            return {"alive": True, "exit_code": None}
        return {"alive": False, "exit_code": None}

    def _pages(self, pid: int) -> dict[str, Any]:
        """Where a lazily restored tree's memory stands ({"pages": ...}; {}: restored whole)."""
        stream = self.streams.get(pid)
        return {"pages": stream.report()} if stream is not None else {}

    def trees(self, caller: Caller, args: p.TreesArgs, progress: Progress) -> Result:
        """The caller's live trees, as this helper recorded them (also after a restart)."""
        return {"trees": [{"pid": t.pid, "namespace": t.namespace}
                          for t in self.registry.owned_by(caller.uid)]}


def _reap_replaced(job: Callable[[], RestoreJob | None]) -> None:
    """A replaced tree killed without waiting (KillReplaced): wait for its exit and reap it,
    before its hold ends (after the restore, or when it fails)."""
    restore = job()
    if restore is not None and restore.replace is not None and restore.replaced_exiting:
        try:
            terminate_tree(restore.replace)
        except RequestError as exc:
            log.error("the tree %d a restore replaced did not exit: %s", restore.replace.pid,
                      exc.message)


def _init_cwd_key(tree: Held) -> tuple[str, int, int] | None:
    """Dumps of trees whose inits share a cwd share CRIU's mount point: their lock's key."""
    try:
        st = os.stat(f"/proc/{tree.pid}/cwd")
    except OSError:
        return None
    if not tree.alive():
        raise RequestError("no_such_process", f"the tree of {tree.pid} has exited")
    return ("nsinit-cwd", st.st_dev, st.st_ino)


