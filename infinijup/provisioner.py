"""The kernel provisioner: kernels that Infinijup can snapshot and restore.

Named in a kernelspec's ``metadata.kernel_provisioner`` as ``infinijup-provisioner``. It keeps
``LocalProvisioner``'s connection-file handling (on owner-only unix sockets, endpoints.py), but the kernel is launched by the
privileged helper under a small init in its own PID namespace (so a restore gets the snapshot's
PIDs back), with stdio to a log file. The kernel is tracked by pid, since after a restore it is
no child of ours; while a restore is under way the kernel is reported alive, so the restarter
never mistakes a restore for a death.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.local_provisioner import LocalProvisioner

from . import config, endpoints
from .gpu import arena as gpu_arena
from .helper_client import HelperClient
from .process import TrackedProcess

# Environment a kernel must not inherit: the parent poller would shut a restored kernel down,
# since its parent is no longer the process that launched it; and the server's (or JupyterHub's)
# own credentials, which would otherwise sit in every kernel's memory and so in every snapshot
# (docs/security.md). The magics sign with the kernel's message key instead (kernel_auth.py).
_SCRUBBED_ENV = ("JPY_PARENT_PID", "JUPYTER_TOKEN", "JPY_API_TOKEN", "JUPYTERHUB_API_TOKEN",
                 "JUPYTER_PASSWORD", config.SERVER_TOKEN_ENV)


class InfinijupProvisioner(LocalProvisioner):
    """Launches kernels through ``infinijup_helper`` and follows them across restores."""

    tracked: TrackedProcess | None = None
    hibernated: bool = False  # no process, on purpose: the next request wakes it (hibernation.py)
    on_discard: Any = None  # called when a hibernated kernel is shut down (its record goes)
    # Asks the kernel's lifecycle (engine/lifecycle.py) whether its process is away on purpose:
    # hibernated, or being replaced by a restore (set by the snapshot manager)
    away_on_purpose: Any = None
    log_path: str | None = None
    launches: int = 0  # +1 per launch: a restart gives the kernel a fresh state

    @property
    def has_process(self) -> bool:
        # A hibernated or restoring kernel counts as running: jupyter_client's restarter would
        # otherwise take it for dead and start a fresh one beside it.
        return self.tracked is not None or self.hibernated or self._away()

    def has_live_process(self) -> bool:
        """Is the kernel's process (its tree's init) alive right now?"""
        return self.tracked is not None and self.tracked.alive()

    def _away(self) -> bool:
        return self.away_on_purpose is not None and self.away_on_purpose()

    def helper(self) -> HelperClient:
        return HelperClient(config.helper_socket())

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        # Before the connection file is written: the kernel listens on unix sockets in a
        # directory only its owner can enter (endpoints.py), never on TCP ports. Its key is
        # Jupyter's, one per kernel session (a restored kernel is given it: retarget.py).
        km = self.parent
        km.transport = "ipc"
        km.cache_ports = False
        km.ip = await asyncio.to_thread(endpoints.prepare, str(self.kernel_id))
        kwargs = await super().pre_launch(**kwargs)
        env = dict(kwargs.get("env") or os.environ)
        for name in _SCRUBBED_ENV:
            env.pop(name, None)
        env[config.KERNEL_ID_ENV] = str(self.kernel_id)
        kwargs["env"] = env
        return kwargs

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        self.hibernated = False  # a (re)start is a fresh kernel
        helper = self.helper()
        work_dir = Path(await asyncio.to_thread(helper.work_dir))  # hello: the user's dirs
        logs = work_dir / "logs"
        logs.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.log_path = str(logs / f"kernel-{self.kernel_id}.log")
        cwd = str(kwargs.get("cwd") or os.getcwd())
        env = dict(kwargs["env"])
        # PyTorch's GPU memory on the VMM allocator (gpu/arena.py): in the helper's arena,
        # which that hello made for this user, where it has one
        arena = await asyncio.to_thread(gpu_arena.prepare_root)
        if arena is not None:
            env[gpu_arena.ROOT_ENV] = str(arena)
        else:
            env.pop(gpu_arena.ROOT_ENV, None)
        pid = await asyncio.to_thread(helper.spawn, list(cmd), env, cwd, self.log_path)
        self.attach(pid)
        self.launches += 1
        self.cwd = cwd
        return self.connection_info

    # --- following the kernel ---------------------------------------------------------
    def attach(self, pid: int | TrackedProcess, keep_old: bool = False) -> TrackedProcess | None:
        """Follow ``pid`` (or a process already held) as this kernel's process (at launch,
        after a restore). ``keep_old``: the process followed until now is handed back, still
        held (a kernel an undo set aside: engine/set_aside.py)."""
        old = self.tracked
        if old is not None and not keep_old:
            old.close()
            old = None
        self.tracked = pid if isinstance(pid, TrackedProcess) else TrackedProcess.attach(pid)
        pid = self.tracked.pid
        self.pid = pid
        self.pgid = None
        self.hibernated = False
        return old

    @property
    def root_pid(self) -> int | None:
        """Host pid of the kernel tree's root (the namespace's init)."""
        return self.tracked.pid if self.tracked else None

    async def poll(self) -> int | None:
        if self.hibernated or self._away():  # not dead: the restarter must leave it be
            return None
        if self.tracked is None:
            return 0
        if self.tracked.alive():
            return None
        return await self._exit_code()

    async def _exit_code(self) -> int:
        try:
            status = await asyncio.to_thread(self.helper().status, self.tracked.pid)
            code = status.exit_code
            return int(code) if code is not None else 1
        except Exception:
            return 1

    def _end_hibernation(self) -> bool:
        """Shut down (or restarted) while hibernated: nothing runs, the snapshot stays in the
        history; the kernel is over. True if it was hibernated."""
        if not self.hibernated:
            return False
        self.hibernated = False
        if self.on_discard is not None:
            self.on_discard()
        return True

    async def shutdown_requested(self, restart: bool = False) -> None:
        self._end_hibernation()
        await super().shutdown_requested(restart=restart)

    async def wait(self) -> int | None:
        if self._end_hibernation():
            return 0
        if self.tracked is None:
            return 0
        while await self.poll() is None:
            await asyncio.sleep(0.1)
        code = await self._exit_code()
        self.tracked.close()
        self.tracked = None
        return code

    async def send_signal(self, signum: int) -> None:
        # The namespace's init forwards signals to the kernel. It runs as root (CRIU needs
        # that to dump the namespace), so a server that is not root asks the helper.
        if self.tracked is None or not self.tracked.alive():
            return
        if os.geteuid() == 0:
            os.kill(self.tracked.pid, signum)
        else:
            await asyncio.to_thread(self.helper().signal, self.tracked.pid, signum)

    async def kill(self, restart: bool = False) -> None:
        self._end_hibernation()
        if self.tracked is not None and self.tracked.alive():
            try:
                await asyncio.to_thread(self.helper().kill, self.tracked.pid)
            except Exception:
                await self.send_signal(signal.SIGKILL)

    async def end_process(self) -> None:
        """End the kernel's tree and forget it (hibernation: the kernel itself stays)."""
        gpu_arena.remove_kernel(str(self.kernel_id))
        if self.tracked is not None:
            if self.tracked.alive():
                await asyncio.to_thread(self.helper().kill, self.tracked.pid)
            while self.tracked.alive():
                await asyncio.sleep(0.05)
            self.tracked.close()
            self.tracked = None

    async def terminate(self, restart: bool = False) -> None:
        self._end_hibernation()
        await self.send_signal(signal.SIGTERM)

    async def cleanup(self, restart: bool = False) -> None:
        await super().cleanup(restart=restart)
        gpu_arena.remove_kernel(str(self.kernel_id))  # a fresh kernel, or none: no segments
        if not restart and not self.hibernated:
            await asyncio.to_thread(endpoints.remove, str(self.kernel_id))

    async def get_provisioner_info(self) -> dict:
        info = await super().get_provisioner_info()
        info["log_path"] = self.log_path
        return info

    async def load_provisioner_info(self, provisioner_info: dict) -> None:
        await super().load_provisioner_info(provisioner_info)
        self.log_path = provisioner_info.get("log_path")
        if self.pid:
            self.attach(int(self.pid))
