"""One method per op. No socket code: the server hands in a caller, typed args and a progress
callback, and gets back the result object or a :class:`RequestError`.

Operations on the same pid are serialized (a dump racing a kill of the same tree would leave
either half-done); operations on different trees run concurrently.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from . import protocol as p
from .checkpoint import (
    CriuDump,
    CriuRestore,
    DumpJob,
    KillReplaced,
    PublishImages,
    RestoreJob,
    StageImages,
    VerifyDumpedCreds,
    terminate_tree,
)
from .criu import Criu
from .cuda_stage import CudaResumeAfterDump, CudaResumeRestored, CudaSuspend, resume_tree
from .paths import WorkDirs, check_target_free, remove_entry
from .proc import (
    CAP_SYS_RESOURCE,
    Caller,
    authorize_pid,
    authorize_tree,
    has_capability,
    read_proc,
)
from .protocol import RequestError
from .reaper import Reaper
from .retarget import RetargetImages, RetargetPlan
from .seal import Sealer
from .spawn import SpawnFailed, SpawnSpec, spawn_tree
from .stages import Progress, Stage, run_stages

Result = Mapping[str, Any]


class PidLocks:
    """One lock per pid, created on demand and dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[int, tuple[threading.Lock, int]] = {}

    @contextlib.contextmanager
    def hold(self, pid: int | None) -> Iterator[None]:
        if pid is None:
            yield
            return
        with self._guard:
            lock, users = self._locks.get(pid, (threading.Lock(), 0))
            self._locks[pid] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._locks[pid]
                if users == 1:
                    del self._locks[pid]
                else:
                    self._locks[pid] = (lock, users - 1)


def caller_groups(caller: Caller) -> tuple[int, ...]:
    """The caller's gid and supplementary groups, as initgroups(3) would set them."""
    try:
        name = pwd.getpwuid(caller.uid).pw_name
    except KeyError:
        return (caller.gid,)
    return tuple(dict.fromkeys([caller.gid, *os.getgrouplist(name, caller.gid)]))


@dataclass(frozen=True)
class Features:
    cuda: bool = False

    @classmethod
    def detect(cls) -> Features:
        """CUDA stages only where the driver's checkpoint API is usable."""
        try:
            from infinijup.gpu import driver

            return cls(cuda=driver.available())
        except Exception:
            return cls(cuda=False)


def _gpu_summary(stages: list[Stage]) -> dict[str, Any] | None:
    for stage in stages:
        summary = getattr(stage, "summary", None)
        if summary:
            return summary
    return None


class Operations:
    """The helper's ops, bound to its work dirs, CRIU, reaper and seal key."""

    def __init__(
        self,
        work: WorkDirs,
        criu: Criu,
        reaper: Reaper,
        sealer: Sealer,
        python: str = sys.executable,
        features: Features = Features(),
        pid_namespace: bool | None = None,
    ) -> None:
        self.work = work
        self.criu = criu
        self.reaper = reaper
        self.sealer = sealer
        self.python = python
        self.features = features
        # Kernels get their own PID namespace, except where CUDA is usable: the CUDA driver
        # fails to initialize (error 304) in a PID namespace without its own /proc, and CRIU
        # cannot dump the mount namespace such a /proc needs. Restores then need the original
        # pids free, which they are when a kernel is restored in place.
        self.pid_namespace = (not features.cuda) if pid_namespace is None else pid_namespace
        self.locks = PidLocks()
        self.can_dump_other_users = has_capability(CAP_SYS_RESOURCE)
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
        }
        assert set(self._handlers) == p.OPS

    def handle(self, caller: Caller, request: p.Request, progress: Progress) -> Result:
        return self._handlers[request.op](caller, request.args, progress)

    # --- pipelines (the hook for GPU stages) ---------------------------------------------------

    def dump_stages(self) -> list[Stage]:
        stages: list[Stage] = [
            CriuDump(self.criu),
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
            KillReplaced(self.reaper),
            CriuRestore(self.criu, self.reaper),
        ]
        if self.features.cuda:
            stages.append(CudaResumeRestored())
        return stages

    # --- ops ----------------------------------------------------------------------------------

    def hello(self, caller: Caller, args: p.HelloArgs, progress: Progress) -> Result:
        return {
            "version": p.VERSION,
            "criu_version": self.criu.version,
            "uid": caller.uid,
            "work_dir": self.work.user_dir(caller),
            "features": {"cuda": self.features.cuda, "pid_namespace": self.pid_namespace},
        }

    def spawn(self, caller: Caller, args: p.SpawnArgs, progress: Progress) -> Result:
        if not os.path.isabs(args.cwd):
            raise RequestError("bad_path", f"{args.cwd!r}: cwd must be an absolute path")
        log_path = self.work.confine_file(caller, args.log_path)
        spec = SpawnSpec(
            argv=list(args.argv),
            env=dict(args.env),
            cwd=args.cwd,
            log_path=log_path,
            uid=caller.uid,
            gid=caller.gid,
            groups=list(caller_groups(caller)),
            python=self.python,
            nsinit_cwd=self.work.nsinit_cwd,
            pid_namespace=self.pid_namespace,
        )
        try:
            pid = spawn_tree(spec)
        except SpawnFailed as exc:
            raise RequestError("spawn_failed", str(exc)) from None
        self.reaper.track(pid, caller.uid)
        return {"pid": pid}

    def dump(self, caller: Caller, args: p.DumpArgs, progress: Progress) -> Result:
        start = time.monotonic()
        with self.locks.hold(args.pid):
            authorize_pid(caller, args.pid, tree_root=True)
            if not caller.is_root and not self.can_dump_other_users:
                raise RequestError(
                    "unsupported",
                    "this helper's root lacks CAP_SYS_RESOURCE (a restricted container or sandbox), "
                    "which CRIU needs to read another user's resource limits: only root's trees can "
                    "be dumped here",
                )
            authorize_tree(caller, args.pid)
            parent_fd, name = self.work.open_parent(caller, args.images_dir)
            try:
                check_target_free(parent_fd, name, args.images_dir)
                with self.work.staging("dump") as staging:
                    job = DumpJob(
                        caller=caller,
                        pid=args.pid,
                        leave_running=args.leave_running,
                        allowed_gids=caller_groups(caller),
                        staging=staging,
                        parent_fd=parent_fd,
                        name=name,
                    )
                    stages = self.dump_stages()
                    phases = run_stages(stages, job, progress)
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
        with self.locks.hold(args.replace_pid), contextlib.ExitStack() as cleanup:
            pidfd = None
            if args.replace_pid is not None:
                pidfd = _pidfd(args.replace_pid)
                cleanup.callback(os.close, pidfd)
                authorize_pid(caller, args.replace_pid, tree_root=True)
            log_path = (self.work.confine_file(caller, args.log_path)
                        if args.log_path is not None else None)
            images_fd = self.work.open_dir(caller, args.images_dir)
            cleanup.callback(os.close, images_fd)
            staging = cleanup.enter_context(self.work.staging("restore"))
            job = RestoreJob(
                caller=caller,
                images_fd=images_fd,
                allowed_gids=caller_groups(caller),
                staging=staging,
                replace_pid=args.replace_pid,
                replace_pidfd=pidfd,
                gpu_map=args.gpu_map,
                retarget=RetargetPlan(port_map=args.port_map, log_path=log_path),
            )
            stages = self.restore_stages()
            phases = run_stages(stages, job, progress)
        return {"pid": job.pid, "duration_s": round(time.monotonic() - start, 6), "phases": phases,
                "gpu": _gpu_summary(stages), "retargeted": job.retargeted}

    def kill(self, caller: Caller, args: p.KillArgs, progress: Progress) -> Result:
        with self.locks.hold(args.pid):
            pidfd = _pidfd(args.pid)
            try:
                authorize_pid(caller, args.pid, tree_root=True)
                terminate_tree(pidfd, args.pid, self.reaper)
            finally:
                os.close(pidfd)
        return {}

    def gpu(self, caller: Caller, args: p.GpuArgs, progress: Progress) -> Result:
        """Release a live kernel's GPUs (VRAM to host memory) or take them back, without CRIU:
        the building block for idle kernels that give their GPU back."""
        if not self.features.cuda:
            raise RequestError("unsupported", "no usable CUDA driver on this machine")
        with self.locks.hold(args.pid):
            authorize_pid(caller, args.pid, tree_root=True)
            start = time.monotonic()
            if args.action == "release":
                stage = CudaSuspend(args.pid)
                stage.run(None)
                summary = stage.summary or {"pids": 0}
            else:
                summary = resume_tree(args.pid)
        return {"duration_s": round(time.monotonic() - start, 6), "gpu": summary}

    def signal(self, caller: Caller, args: p.SignalArgs, progress: Progress) -> Result:
        """Signal a tree's init, which forwards it to the kernel. Needed because the init runs
        as root (see nsinit.py), so the caller cannot signal it directly."""
        with self.locks.hold(args.pid):  # not into a dump: a pending signal would be dumped
            pidfd = _pidfd(args.pid)
            try:
                authorize_pid(caller, args.pid, tree_root=True)
                signal.pidfd_send_signal(pidfd, args.signum)
            finally:
                os.close(pidfd)
        return {}

    def release(self, caller: Caller, args: p.ReleaseArgs, progress: Progress) -> Result:
        parent_fd, name = self.work.open_parent(caller, args.path)
        try:
            remove_entry(parent_fd, name)
        finally:
            os.close(parent_fd)
        return {}

    def status(self, caller: Caller, args: p.StatusArgs, progress: Progress) -> Result:
        info = read_proc(args.pid)
        if info is not None and not info.is_zombie:
            try:
                authorize_pid(caller, args.pid, tree_root=False)
                return {"alive": True, "exit_code": None}
            except RequestError as exc:
                if exc.reason != "no_such_process":
                    raise
                info = read_proc(args.pid)  # it exited between the two reads: report that
        if info is not None and self.reaper.is_tracked(args.pid):
            self.reaper.wait_reaped(args.pid, 2.0)  # exited a moment ago; let the reaper finish
        record = self.reaper.exit_record(args.pid)
        if record is not None and (caller.is_root or record.owner_uid == caller.uid):
            return {"alive": False, "exit_code": record.exit_code}
        return {"alive": False, "exit_code": None}


def _pidfd(pid: int) -> int:
    """A handle on exactly this process, taken *before* it is authorized, so the process that
    was checked is the one that gets signalled even if the pid is recycled meanwhile."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise RequestError("no_such_process", f"no running process with pid {pid}") from None
    except FileNotFoundError:  # ENOENT (Linux >= 6.9): the id of a thread, not of a process
        raise RequestError("no_such_process", f"{pid} is not a process id (a thread's?)") from None
