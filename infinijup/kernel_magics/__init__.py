"""Infinijup inside the kernel: magics, and hooks for libraries to quiesce and resume."""

from __future__ import annotations

from .hooks import register_quiesce_hook, register_resume_hook, unregister_hook

__all__ = ["register_quiesce_hook", "register_resume_hook", "unregister_hook", "load_ipython_extension"]


def load_ipython_extension(ipython) -> None:  # noqa: ANN001 - IPython's own type
    from .gpu_sync import synchronize_gpus
    from .magics import InfinijupMagics

    register_quiesce_hook(synchronize_gpus)
    ipython.register_magics(InfinijupMagics)
