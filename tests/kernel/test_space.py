"""Getting space back through the real server, helper and CRIU (serverext/space.py, issue 28
item 8): the sizes of the store and of the hot tier; deleting the tip of a thread moves the
thread back, gc gives the bytes back and the hot copy goes; what a running kernel's HEAD is,
or what a hibernated kernel sleeps in, is refused with 409 and the reason."""

from __future__ import annotations

import json

import pytest
from kernelkit import needs_helper

pytestmark = [needs_helper, pytest.mark.timeout(600)]


def manager(jp_serverapp):
    return jp_serverapp.web_app.settings["infinijup_manager"]


def hot_commits(jp_serverapp) -> set[str]:
    return {e.commit for e in manager(jp_serverapp).engine().hot_tier().entries()}


async def stats(nb) -> dict:
    r = await nb.fetch("infinijup", "stats")
    assert r.code == 200, r.body
    return json.loads(r.body)


async def test_delete_a_tip_and_refuse_what_kernels_stand_on(notebook, jp_serverapp):
    nb = notebook
    await nb.execute("import numpy as np\nblob = np.random.default_rng(1).bytes(30_000_000)")
    s1 = (await nb.snapshot(message="one"))["commit"]
    await nb.execute("blob2 = np.random.default_rng(2).bytes(30_000_000)")
    s2 = (await nb.snapshot(message="two"))["commit"]
    assert {s1, s2} <= hot_commits(jp_serverapp)

    before = await stats(nb)
    assert before["store_bytes"] > 60_000_000, before  # two 30 MB random blobs, stored
    assert before["hot_bytes"] > 60_000_000 and before["hot_entries"] >= 2, before
    assert before["text"].startswith("Store ") and " · hot copies " in before["text"]

    # the kernel stands on s2 (its HEAD): refused, nothing moves
    r = await nb.post("delete", {"kernel_id": nb.kernel_id, "commit": s2})
    assert r.code == 409, r.body
    body = json.loads(r.body)
    assert body["reason"] == "snapshot_in_use" and "HEAD" in body["message"], body
    # s1 has a child: refused
    r = await nb.post("delete", {"kernel_id": nb.kernel_id, "commit": s1})
    assert r.code == 409 and json.loads(r.body)["reason"] == "snapshot_has_children", r.body

    await nb.restore(s1)
    assert await nb.value("'blob2' in globals()") is False
    r = await nb.post("delete", {"kernel_id": nb.kernel_id, "commit": s2[:12]})
    assert r.code == 200, r.body
    done = json.loads(r.body)
    assert done["commit"] == s2 and done["threads"] == {"main": s1}, done
    assert done["removed"] == [s2] and done["hot_dropped"] == 1, done
    assert done["freed_bytes"] > 25_000_000, done  # blob2's bytes left the packs

    history = await nb.history()
    assert [c["id"] for c in history["commits"]] == [s1]
    assert history["threads"] == {"main": s1}
    assert s2 not in hot_commits(jp_serverapp) and s1 in hot_commits(jp_serverapp)
    after = await stats(nb)
    assert after["store_bytes"] < before["store_bytes"] - 25_000_000, (before, after)
    assert after["hot_bytes"] < before["hot_bytes"], (before, after)

    # an unknown snapshot, a thread of no one
    r = await nb.post("delete", {"kernel_id": nb.kernel_id, "commit": "ab" * 32})
    assert r.code == 404, r.body
    r = await nb.post("delete", {"kernel_id": nb.kernel_id, "thread": "nope"})
    assert r.code == 404 and json.loads(r.body)["reason"] == "unknown_thread", r.body
    r = await nb.post("delete", {"kernel_id": nb.kernel_id})
    assert r.code == 400, r.body

    # hibernated: its snapshot (a new thread next to main, from s1) and its thread are refused
    await nb.execute("changed = True")
    r = await nb.post("hibernate", {"kernel_id": nb.kernel_id})
    assert r.code == 200, r.body
    s3 = json.loads(r.body)["commit"]
    assert s3 != s1
    threads = (await nb.history())["threads"]
    (sleeping,) = [name for name, tip in threads.items() if tip == s3]
    r = await nb.post("delete", {"path": nb.path, "commit": s3})
    assert r.code == 409, r.body
    body = json.loads(r.body)
    assert body["reason"] == "snapshot_in_use" and "hibernated" in body["message"], body
    r = await nb.post("delete", {"path": nb.path, "thread": sleeping})
    assert r.code == 409 and "hibernated" in json.loads(r.body)["message"], r.body
    assert (await nb.history())["threads"] == threads

    # awake again, on s3: deleting main frees nothing (s1 is s3's parent) and is allowed
    assert await nb.value("'blob' in globals()") is True
    r = await nb.post("delete", {"path": nb.path, "thread": "main"})
    assert r.code == 200, r.body
    assert json.loads(r.body)["removed"] == []
    assert (await nb.history())["threads"] == {sleeping: s3}
