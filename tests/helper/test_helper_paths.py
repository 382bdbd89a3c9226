"""Every path must stay inside the caller's work dir: traversal, symlinks, relative -> bad_path."""

from __future__ import annotations

import os

import pytest
from helperkit import PYTHON, kernel_env, needs_root_and_criu

pytestmark = needs_root_and_criu


@pytest.fixture
def sleeper(client, trees) -> int:
    work = client.work_dir()
    return trees.add(
        client.spawn(
            [PYTHON, "-c", "import time; time.sleep(3600)"],
            kernel_env(),
            work,
            os.path.join(work, "sleeper.log"),
        )
    )


def _bad_path(call) -> str:
    from infinijup.errors import BadRequest

    with pytest.raises(BadRequest) as info:
        call()
    assert info.value.reason == "bad_path", info.value
    return str(info.value)


def test_work_dir_is_private_and_owned(client) -> None:
    work = client.work_dir()
    st = os.stat(work)
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o700)
    assert oct(os.stat(os.path.dirname(work)).st_mode & 0o777) == "0o711"


def test_bad_dump_targets(client, sleeper: int, tmp_path) -> None:
    work = client.work_dir()
    outside = str(tmp_path)
    link = os.path.join(work, "escape-link")
    if not os.path.islink(link):
        os.symlink(outside, link)
    cases = {
        "relative": "images",
        "traversal": os.path.join(work, "..", "..", "etc-images"),
        "traversal inside": os.path.join(work, "a", "..", "b"),
        "outside": os.path.join(outside, "images"),
        "symlink escape": os.path.join(link, "images"),
        "the work dir itself": work,
        "another uid's dir": os.path.join(os.path.dirname(work), "12345", "images"),
    }
    for what, path in cases.items():
        message = _bad_path(lambda path=path: client.dump(sleeper, path))
        assert message, what
    assert os.listdir(outside) == []


def test_dump_target_must_be_empty(client, sleeper: int) -> None:
    work = client.work_dir()
    full = os.path.join(work, "full-dir")
    os.makedirs(full, exist_ok=True)
    open(os.path.join(full, "x"), "w").close()
    assert "empty" in _bad_path(lambda: client.dump(sleeper, full))
    client.release(full)
    assert not os.path.exists(full)


def test_symlinked_final_component_is_not_followed(client, tmp_path) -> None:
    work = client.work_dir()
    victim_dir = str(tmp_path)
    victim = os.path.join(victim_dir, "keep-me")
    open(victim, "w").close()
    link = os.path.join(work, "link-to-victim")
    os.symlink(victim, link)
    client.release(link)  # removes the link, never its target
    assert os.path.exists(victim) and not os.path.lexists(link)
    # A symlinked parent pointing outside is refused outright.
    os.symlink(victim_dir, link)
    _bad_path(lambda: client.release(os.path.join(link, "keep-me")))
    assert os.path.exists(victim)
    os.unlink(link)


def test_bad_restore_sources_and_log_paths(client) -> None:
    work = client.work_dir()
    _bad_path(lambda: client.restore("relative/images"))
    _bad_path(lambda: client.restore("/etc"))
    _bad_path(lambda: client.restore(os.path.join(work, "does-not-exist")))
    _bad_path(lambda: client.release("/etc/passwd"))
    _bad_path(lambda: client.release(os.path.join(work, "..")))
    _bad_path(lambda: client.spawn([PYTHON], kernel_env(), work, "/tmp/kernel.log"))
    _bad_path(
        lambda: client.spawn([PYTHON], kernel_env(), "relative-cwd", os.path.join(work, "k.log"))
    )
    assert os.path.exists("/etc/passwd")


def test_release_is_idempotent(client) -> None:
    path = os.path.join(client.work_dir(), "never-existed")
    client.release(path)
    client.release(path)
