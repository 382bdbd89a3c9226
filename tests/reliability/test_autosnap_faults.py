"""Automatic snapshots when the helper is gone (issue 30): the user's cells succeed, the failure
is said once (not per cell) and counted, and once the helper is back the next cell worth it is
snapshotted again."""

from __future__ import annotations

import pytest
from reliakit import needs_helper

pytestmark = [needs_helper, pytest.mark.timeout(300)]

SLOW = "time.sleep(1.1)\n"
SAID = "automatic snapshot failed"


async def test_a_failing_automatic_snapshot_never_fails_the_cell(notebook, rhelper):
    nb = notebook
    await nb.execute("%autosnapshot on after=1 share=0.000001")
    await nb.execute("import time")
    rhelper.kill()
    first = await nb.execute(SLOW + "x = 1")  # (execute asserts the cell did not fail)
    assert SAID in first["stderr"], first
    second = await nb.execute(SLOW + "x = 2")
    assert SAID not in second["stderr"], second  # said once
    status = (await nb.execute("%autosnapshot status"))["stdout"]
    assert "0 taken" in status and "2 failed" in status and "Last error:" in status, status
    assert await nb.value("x") == 2
    rhelper.ensure_running()
    await nb.execute(SLOW + "x = 3")
    status = (await nb.execute("%autosnapshot status"))["stdout"]
    assert "1 taken" in status, status
