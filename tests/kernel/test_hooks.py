"""Library hooks around a snapshot (``register_quiesce_hook``, ``register_resume_hook``) through
the real server, helper and CRIU; and ``SnapshotEngine.release_gpu`` where there is no GPU."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest
from kernelkit import needs_helper

pytestmark = [needs_helper, pytest.mark.timeout(240)]

HAS_GPU = os.path.exists("/dev/nvidiactl") and shutil.which("nvidia-smi") is not None

HOOKS = """
from infinijup.kernel_magics import register_quiesce_hook, register_resume_hook
calls = []
register_quiesce_hook(lambda: calls.append("quiesce"))
register_resume_hook(lambda restored: calls.append(("resume", restored)))
"""


async def test_resume_hook_hears_snapshot_and_restore(notebook):
    nb = notebook
    await nb.execute(HOOKS)
    snap = await nb.snapshot(message="hooked")
    # the kernel goes on after its own snapshot: quiesced, then resumed with restored=False
    assert await nb.value("calls") == ["quiesce", ("resume", False)]
    await nb.execute("calls.append('moved on')")
    await nb.restore(snap["commit"])
    # the image was taken between the two hooks; the restored kernel resumes with True
    assert await nb.value("calls") == ["quiesce", ("resume", True)]
    # a second snapshot, from the restored kernel, calls them again
    await nb.snapshot(message="again")
    assert await nb.value("calls") == ["quiesce", ("resume", True), "quiesce", ("resume", False)]


async def test_failing_hooks_do_not_stop_a_snapshot(notebook):
    nb = notebook
    await nb.execute(HOOKS + "def boom(*_):\n    raise RuntimeError('hook failed')\n"
                     "register_quiesce_hook(boom); register_resume_hook(boom)")
    snap = await nb.snapshot(message="despite the hooks")
    await nb.restore(snap["commit"])
    assert await nb.value("calls") == ["quiesce", ("resume", True)]


@pytest.mark.skipif(HAS_GPU, reason="on a GPU machine release_gpu works: test_gpu_kernel.py")
async def test_release_gpu_without_a_gpu_is_refused_clearly(notebook, jp_serverapp):
    from infinijup.errors import InfinijupError

    nb = notebook
    await nb.execute("x = 'kept'")
    engine = jp_serverapp.web_app.settings["infinijup_manager"].engine()
    root = jp_serverapp.kernel_manager.get_kernel(nb.kernel_id).provisioner.root_pid
    for call in (engine.release_gpu, engine.reacquire_gpu):
        with pytest.raises(InfinijupError) as info:
            await asyncio.to_thread(call, root)
        assert info.value.reason == "unsupported", info.value
        assert "CUDA" in info.value.message, info.value.message
    assert await nb.value("x") == "kept"  # the kernel was not touched
