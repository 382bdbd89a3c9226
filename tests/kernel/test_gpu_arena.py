"""The GPU arena (issue 13) on any machine: where a kernel's segments wait, who may own it,
the server's word to the kernel, and what the store takes in beside the images. The GPU path
itself runs on the GPU machine (test_gpu_kernel.py)."""

from __future__ import annotations

import json
import os
import pwd

import pytest

from infinijup.engine.extra_files import open_extra
from infinijup.errors import SnapshotFailed
from infinijup.gpu import arena
from infinijup.kernel_magics import agent


@pytest.fixture
def root(tmp_path, monkeypatch):
    path = tmp_path / "arena"
    monkeypatch.setenv(arena.ROOT_ENV, str(path))
    monkeypatch.delenv(arena.ALLOCATOR_ENV, raising=False)
    return path


def test_the_root_is_made_private_and_a_foreign_or_linked_one_is_refused(root, tmp_path):
    assert arena.prepare_root() == root
    assert root.stat().st_mode & 0o777 == 0o700
    root.rmdir()
    other = tmp_path / "elsewhere"
    other.mkdir()
    root.symlink_to(other)  # someone made the name first, as a link
    assert arena.prepare_root() is None
    root.unlink()
    root.mkdir(mode=0o755)  # or open to others
    os.chmod(root, 0o755)
    assert arena.prepare_root() is None
    if os.geteuid() == 0:
        os.chmod(root, 0o700)
        nobody = pwd.getpwnam("nobody")
        os.chown(root, nobody.pw_uid, nobody.pw_gid)  # or another user's
        assert arena.prepare_root() is None


def test_switched_off_there_is_no_arena(root, monkeypatch):
    monkeypatch.setenv(arena.ALLOCATOR_ENV, "driver")
    assert arena.prepare_root() is None and arena.segments_path("k1") is None


def test_kernel_ids_and_tokens_cannot_leave_the_root(root):
    assert arena.segments_path("k1") == str(root / "k1" / "segments")
    for bad in ("", "../k", ".hidden", "a/b"):
        assert arena.segments_path(bad) is None
    for bad in ("", "../x", "ABC", "go/../../x"):
        with pytest.raises(ValueError):
            arena.go_path(str(root), bad)


def test_the_word_to_the_kernel_is_written_whole_and_forgotten(root):
    arena.prepare_root()
    arena.say_go("ab12", "/some/copy")
    assert json.loads((root / "go-ab12").read_text()) == {"source": "/some/copy"}
    assert [p.name for p in root.iterdir()] == ["go-ab12"]  # no temporary left
    arena.forget_go("ab12")
    assert not (root / "go-ab12").exists()


def test_a_restore_sets_the_segments_aside_and_a_kernel_end_removes_its_arena(root, tmp_path):
    images = tmp_path / "restore" / "tag"
    images.mkdir(parents=True)
    assert arena.set_aside(images) is None  # a commit without segments
    (images / arena.IMAGE_NAME).write_bytes(b"x" * 10)
    aside = arena.set_aside(images)
    assert aside == str(images.parent / f"tag.{arena.IMAGE_NAME}")
    assert not (images / arena.IMAGE_NAME).exists() and os.path.getsize(aside) == 10
    arena.discard(aside)
    assert not os.path.exists(aside)
    arena.prepare_root()
    kernel_dir = root / "k1"
    kernel_dir.mkdir()
    (kernel_dir / "segments").write_bytes(b"y")
    arena.remove_kernel("k1")
    assert not kernel_dir.exists()


def test_the_store_takes_only_a_regular_file_of_this_user_never_through_a_link(tmp_path):
    f = tmp_path / "segments"
    f.write_bytes(b"z" * 4096)
    fds = open_extra({"gpu-segments": str(f)})
    try:
        assert os.fstat(fds["gpu-segments"]).st_size == 4096
    finally:
        for fd in fds.values():
            os.close(fd)
    link = tmp_path / "link"
    link.symlink_to(f)
    with pytest.raises(SnapshotFailed):
        open_extra({"gpu-segments": str(link)})
    with pytest.raises(SnapshotFailed):
        open_extra({"gpu-segments": str(tmp_path / "missing")})
    with pytest.raises(SnapshotFailed):
        open_extra({"gpu-segments": str(tmp_path)})  # a directory


def test_what_a_kernel_says_about_its_segments_is_checked_field_by_field():
    token = "0123456789abcdef0123456789abcdef"
    meta = agent.commit_metadata({"gpu_segments": {
        "bytes": 5, "segments": 2, "segment_bytes": 8, "seconds": 0.5, "token": token,
        "path": "/etc/shadow", "extra": "x"}})
    assert meta["gpu_segments"] == {"bytes": 5, "segments": 2, "segment_bytes": 8,
                                    "seconds": 0.5, "token": token}
    bad = agent.commit_metadata({"gpu_segments": {"bytes": -1, "token": "../x"}})
    assert "gpu_segments" not in bad
    told = agent.commit_metadata({"gpu_segments": {"fallback": "no allocator" * 100}})
    assert told["gpu_segments"]["fallback"].startswith("no allocator")
    assert len(told["gpu_segments"]["fallback"]) <= 300


def test_the_hot_copy_of_the_segments_keeps_their_holes(tmp_path):
    """Dead ranges are holes in the arena file: the hot tier's copy must not fill them in."""
    from infinijup.engine.extra_files import copy_sparse, data_bytes

    src = tmp_path / "segments"
    with open(src, "wb") as f:
        f.truncate(64 << 20)
        f.seek(8 << 20)
        f.write(b"a" * (1 << 20))
        f.seek(40 << 20)
        f.write(b"b" * 4096)
    fd = os.open(src, os.O_RDONLY)
    try:
        assert data_bytes(fd) <= (1 << 20) + 2 * 4096
        copy_sparse(fd, tmp_path / "copy")
    finally:
        os.close(fd)
    copy = tmp_path / "copy"
    assert copy.read_bytes() == src.read_bytes()
    assert copy.stat().st_blocks * 512 <= (1 << 20) + (64 << 10)


def test_the_helpers_huge_page_arena_is_taken_only_when_it_is_this_users(tmp_path, monkeypatch):
    """Without a configured root the user's directory in the helper's arena (beside its
    socket, made by the helper) is the root; one that is not this user's private directory is
    passed over for /dev/shm."""
    monkeypatch.delenv(arena.ROOT_ENV, raising=False)
    monkeypatch.delenv(arena.ALLOCATOR_ENV, raising=False)
    monkeypatch.setenv("INFINIJUP_HELPER_SOCKET", str(tmp_path / "run" / "helper.sock"))
    mine = tmp_path / "run" / arena.HELPER_ARENA / str(os.geteuid())
    shm = f"/dev/shm/infinijup-{os.geteuid()}"
    assert str(arena.root()) == shm  # no helper arena
    mine.mkdir(parents=True, mode=0o700)
    assert arena.root() == mine and arena.segments_path("k1") == str(mine / "k1" / "segments")
    os.chmod(mine, 0o755)
    assert str(arena.root()) == shm
    mine.rmdir()
    mine.symlink_to(tmp_path)
    assert str(arena.root()) == shm


def test_a_release_or_snapshot_the_arena_cannot_hold_takes_the_driver_path(tmp_path):
    """The arena file is written through a shared mapping: past the tmpfs quota a page would
    kill the kernel with SIGBUS, so the kernel looks at the room first (issue 27). On a tmpfs
    of its own (8 MiB), as the helper mounts one per user."""
    import os
    import subprocess

    from infinijup.kernel_magics.gpu_vmm import _arena_short

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (make test runs as root)")
    arena = tmp_path / "arena"
    arena.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(arena)],
                   check=True)
    try:
        fd = os.open(arena / "segments", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.write(fd, b"x" * (6 << 20))  # 6 of the 8 MiB: pages the file has count as room
            assert _arena_short(fd, str(arena), 8 << 20) is None
            why = _arena_short(fd, str(arena), 9 << 20)
            assert why is not None and "of room, the segments need" in why
        finally:
            os.close(fd)
    finally:
        subprocess.run(["umount", str(arena)], check=True)
