"""A full filesystem mid-snapshot: the store's (a real 64 MiB tmpfs) and the helper's work dir
(another one). A clear error, the kernel keeps running, the store stays consistent, and the
space comes back (``gc`` for the store)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from reliakit import (
    KillableHelper,
    assert_store_ok,
    fill,
    make_base,
    needs_helper,
    state_intact,
    store_cli,
    store_state,
)

pytestmark = [needs_helper, pytest.mark.timeout(240)]

SIZE_MIB = 64


def _mount_tmpfs(size_mib: int) -> Path:
    if shutil.which("mount") is None:
        pytest.skip("mount(8) is not installed")
    where = Path(tempfile.mkdtemp(prefix="ij-small-"))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0755",
                           "tmpfs", str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    return where


def _unmount(where: Path) -> None:
    subprocess.run(["umount", str(where)], check=False)
    if os.path.ismount(where):
        subprocess.run(["umount", "-l", str(where)], check=False)
    where.rmdir()


def _used(where: str | Path) -> int:
    st = os.statvfs(where)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.fixture
def small_fs():
    where = _mount_tmpfs(SIZE_MIB)
    yield where
    _unmount(where)


@pytest.fixture
def store_path(small_fs) -> str:
    """The store on the small filesystem (overrides conftest's)."""
    return str(small_fs / "store")


async def test_store_filesystem_full(notebook, rhelper, store_path, small_fs):
    nb = notebook
    await nb.execute("x = 'small'")
    first = await nb.snapshot(message="fits")  # a kernel's base image fits in 64 MiB
    used_ok = _used(small_fs)
    digest = await fill(nb, 150, seed=51)  # 150 MiB of incompressible memory does not
    before = store_state(store_path)

    r = await nb.post("snapshot", {"kernel_id": nb.kernel_id, "message": "too big"})
    assert r.code == 500, r.body
    body = json.loads(r.body)
    assert body["reason"] == "no_space" and "No space left on device" in body["message"], body
    print(f"full store filesystem: {r.code} {body['reason']}: {body['message'][:160]}")

    # the kernel runs on; nothing partial is visible; the store checks out
    await state_intact(nb, digest, {"x": "small"})
    assert store_state(store_path) == before
    assert_store_ok(store_path)
    assert rhelper.user_entries() == {"images": [], "restore": []}
    # gc gives the space back (and leaves no warning behind)
    used_full = _used(small_fs)
    gc = store_cli(store_path, "gc")
    assert gc.returncode == 0, gc.stdout + gc.stderr
    check = store_cli(store_path, "check", "--read-data")
    assert check.returncode == 0 and "warning" not in check.stdout.lower(), check.stdout
    used_after = _used(small_fs)
    print(f"store fs used: {used_ok >> 20} MiB after the first snapshot, {used_full >> 20} MiB "
          f"after the failed one, {used_after >> 20} MiB after gc")
    assert used_after <= used_ok + (1 << 20)
    # with the memory freed, snapshots fit again and restore
    await nb.execute("del big\nimport gc as _gc; _gc.collect()\nx = 'after'")
    snap = await nb.snapshot(message="fits again")
    await nb.restore(first["commit"])
    assert await nb.value("x") == "small"
    await nb.restore(snap["commit"])
    assert await nb.value("x") == "after"
    assert_store_ok(store_path)


async def test_helper_work_dir_full(open_notebook, rhelper, store_path, monkeypatch):
    """The helper's own filesystem (where CRIU writes) fills up during the dump."""
    fs = _mount_tmpfs(SIZE_MIB)
    base = make_base()
    small = KillableHelper(base, work_dir=str(fs / "work"))
    try:
        small.start()
        monkeypatch.setenv("INFINIJUP_HELPER_SOCKET", small.socket_path)
        nb = await open_notebook("full-work.ipynb")
        await nb.execute("x = 1")
        digest = await fill(nb, 150, seed=52)
        r = await nb.post("snapshot", {"kernel_id": nb.kernel_id})
        assert r.code == 500, r.body
        body = json.loads(r.body)
        assert body["reason"] == "criu_failed", body
        assert "No space left on device" in body["message"] or "ENOSPC" in body["message"], body
        print(f"full helper work dir: {body['reason']}: {body['message'][:200]}")
        await state_intact(nb, digest, {"x": 1})
        assert small.staging_entries() == []  # the partial images are gone
        assert _used(fs) < 4 << 20
        await nb.execute("del big")
        await nb.snapshot(message="fits")
        assert_store_ok(store_path)
        await nb.close()
    finally:
        small.stop()
        _unmount(fs)
        shutil.rmtree(base, ignore_errors=True)
