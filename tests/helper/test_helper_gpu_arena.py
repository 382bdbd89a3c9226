"""The helper's GPU arena (issue 13): a tmpfs with huge pages beside the socket, one private
directory per user, made by ``hello``. Real helper, real mount, a real second account."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from helperkit import MISSING, HelperDaemon, as_user, make_base

from infinijup.gpu import arena as server_arena


def mount_options(path: str) -> str | None:
    """The super block options of the mount at ``path`` (from /proc/self/mountinfo)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == path:
                return fields[-1] + f" fstype={fields[fields.index('-') + 1]}"
    return None


@pytest.fixture
def arena_helper():
    if MISSING:
        pytest.skip(MISSING)
    daemon = HelperDaemon(make_base(), extra_args=("--gpu-arena", "always"))
    daemon.start()
    mount = os.path.join(os.path.dirname(daemon.socket_path), "gpu-arena")
    yield daemon, mount
    daemon.stop()
    daemon.remove()


def test_hello_gives_each_user_a_private_directory_in_a_huge_page_tmpfs(
        arena_helper, other_account, monkeypatch) -> None:
    from infinijup.helper_client import HelperClient

    daemon, mount = arena_helper
    options = mount_options(mount)
    assert options is not None, f"nothing is mounted at {mount}"
    assert "fstype=tmpfs" in options and "huge=within_size" in options, options
    st = os.lstat(mount)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o711)

    mine = HelperClient(daemon.socket_path, timeout=60).hello().arena_dir
    assert mine == os.path.join(mount, "0")

    def theirs() -> dict:
        info = HelperClient(daemon.socket_path, timeout=60).hello()
        d = Path(info.arena_dir)
        (d / "k").mkdir()
        (d / "k" / "segments").write_bytes(b"x" * 4096)
        try:
            os.listdir(mine)
            peeked = True
        except PermissionError:
            peeked = False
        return {"dir": info.arena_dir, "peeked": peeked}

    out = as_user(other_account, theirs)
    assert "value" in out, out
    assert out["value"]["dir"] == os.path.join(mount, str(other_account.pw_uid))
    assert out["value"]["peeked"] is False
    st = os.lstat(out["value"]["dir"])
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (other_account.pw_uid, 0o700)

    # The server picks that directory as its arena root, by the helper's socket.
    monkeypatch.setenv("INFINIJUP_HELPER_SOCKET", daemon.socket_path)
    monkeypatch.delenv(server_arena.ROOT_ENV, raising=False)
    monkeypatch.delenv(server_arena.ALLOCATOR_ENV, raising=False)
    assert server_arena.prepare_root() == Path(mine)

    # A restarted helper takes the mount as it is: the files in it stay.
    daemon.stop()
    daemon.start()
    assert mount_options(mount).count("huge=within_size") == 1
    assert Path(out["value"]["dir"], "k", "segments").read_bytes() == b"x" * 4096
    assert len([ln for ln in open("/proc/self/mountinfo") if ln.split()[4] == mount]) == 1


def test_by_default_the_arena_is_there_only_where_cuda_is(helper, client) -> None:
    info = client.hello()
    mount = os.path.join(os.path.dirname(helper.socket_path), "gpu-arena")
    if info.features["cuda"]:
        assert info.arena_dir == os.path.join(mount, "0")
        assert "huge=within_size" in (mount_options(mount) or "")
    else:
        assert info.arena_dir is None
        assert not os.path.exists(mount)
