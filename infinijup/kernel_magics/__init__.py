"""Infinijup inside the kernel: magics, and hooks for libraries to quiesce and resume."""

from __future__ import annotations

from .engines import register_engine, unregister_engine
from .hooks import register_quiesce_hook, register_resume_hook, unregister_hook

__all__ = ["register_engine", "register_quiesce_hook", "register_resume_hook", "unregister_engine",
           "unregister_hook", "load_ipython_extension"]


def load_ipython_extension(ipython) -> None:  # noqa: ANN001 - IPython's own type
    # Everything the server's agent and the magics use is imported now, at start-up: a module
    # first imported by a snapshot would be a change the user can see in sys.modules.
    from . import agent, autosnap, describe, gpu_vmm, isolation, retarget  # noqa: F401
    from .gpu_sync import synchronize_gpus
    from .magics import InfinijupMagics

    isolation.install()
    isolation.track_last_result(ipython)
    register_quiesce_hook(synchronize_gpus)
    ipython.events.register("pre_run_cell", gpu_vmm.before_cell)
    ipython.register_magics(InfinijupMagics)
    autosnap.install(ipython)  # after the cell hooks above: a snapshot sees their work done
