"""Who may do what: a second real account against root's kernel (launched by the real server),
the store's and the helper's file modes, and the REST API's authentication and authorization.

Root's server runs with ``allow_unauthenticated_access=False``. The second account runs a
Jupyter server of its own (a real ``jupyter server`` process, as that account, with its own
token, store and kernels): its real credentials are what root's routes must refuse (403), and
its own kernels must snapshot, restore and branch through its own server, as a plain account,
here. The store lives in a 0755 directory, so only its own modes keep other users out.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from reliakit import (
    ServerProcess,
    as_user,
    checkout_closed_to,
    fill,
    make_base,
    modes_under,
    needs_helper,
    provisioner,
    store_state,
)
from tornado.httpclient import AsyncHTTPClient

pytestmark = [needs_helper, pytest.mark.timeout(180)]


async def test_other_user_cannot_touch_roots_kernel(notebook, jp_serverapp, rhelper,
                                                    store_path, other_user):
    from infinijup.helper_client import HelperClient

    nb = notebook
    digest = await fill(nb, 20, seed=71)
    await nb.execute("secret = 'hunter2'")
    snap = await nb.snapshot(message="holds a secret")
    root = provisioner(jp_serverapp, nb.kernel_id).root_pid
    helper = HelperClient(rhelper.socket_path, timeout=60)
    root_work = helper.work_dir()
    root_images = os.path.join(root_work, "images-for-the-test")
    helper.dump(root, root_images)  # root's own images, in root's work dir

    other = HelperClient(rhelper.socket_path, timeout=60)
    hello = as_user(other_user, lambda: other.hello().__dict__)["value"]
    theirs = hello["work_dir"]
    assert hello["uid"] == other_user.pw_uid and theirs != root_work
    # a symlink of theirs pointing at root's images, and one pointing at /etc
    for name, target in (("to-root-images", root_images), ("to-etc", "/etc")):
        link = os.path.join(theirs, name)
        os.symlink(target, link)
        os.lchown(link, other_user.pw_uid, other_user.pw_gid)

    attempts = {
        "dump root's kernel": (lambda: other.dump(root, os.path.join(theirs, "stolen")),
                               "permission_denied"),
        "restore over root's kernel": (
            lambda: other.restore(os.path.join(theirs, "nothing"), replace_pid=root),
            "permission_denied"),
        "kill root's kernel": (lambda: other.kill(root), "permission_denied"),
        "signal root's kernel": (lambda: other.signal(root, 2), "permission_denied"),
        "status of root's kernel": (lambda: other.status(root), "permission_denied"),
        "restore root's images": (lambda: other.restore(root_images), "bad_path"),
        "restore them through a symlink": (
            lambda: other.restore(os.path.join(theirs, "to-root-images")), "bad_path"),
        "release root's images": (lambda: other.release(root_images), "bad_path"),
        "release through a symlink": (
            lambda: other.release(os.path.join(theirs, "to-root-images", "pstree.img")),
            "bad_path"),
        "dump into /etc through a symlink": (
            lambda: other.dump(root, os.path.join(theirs, "to-etc", "x")), "permission_denied"),
        "log into root's work dir": (
            lambda: other.spawn(["/bin/true"], {}, "/", os.path.join(root_work, "x.log")),
            "bad_path"),
        "traversal": (lambda: other.release(os.path.join(theirs, "..", "0")), "bad_path"),
    }
    for what, (attempt, reason) in attempts.items():
        result = as_user(other_user, attempt)
        assert result.get("error") == reason, (what, result)

    # reading root's images directly: the work dir and the images are owner-only
    for path in (root_work, root_images, os.path.join(root_images, "pstree.img")):
        assert as_user(other_user, lambda p=path: os.listdir(p) if os.path.isdir(p)
                       else open(p, "rb").read(1)).get("error") == "PermissionError", path
    assert stat.S_IMODE(os.stat(root_images).st_mode) == 0o700
    assert {stat.S_IMODE(os.stat(os.path.join(root_images, n)).st_mode)
            for n in os.listdir(root_images)} == {0o600}

    # nothing happened to the kernel, its snapshot or the store
    assert helper.status(root).alive
    assert await nb.value("secret") == "hunter2"
    assert await nb.value("__import__('hashlib').sha256(big).hexdigest()") == digest
    assert snap["commit"] in store_state(store_path)["commits"]
    helper.release(root_images)
    for name in ("to-root-images", "to-etc"):
        os.unlink(os.path.join(theirs, name))


async def test_store_is_owner_only(notebook, store_path, other_user):
    """Snapshot images hold process memory (secrets): every store file is 0600, every
    directory 0700, and another user can open none of them."""
    nb = notebook
    await nb.execute("secret = 'hunter2-' * 1000")
    await nb.snapshot(message="one")
    await nb.execute("secret2 = 'swordfish'")
    await nb.snapshot(message="two")
    assert stat.S_IMODE(os.stat(os.path.dirname(store_path)).st_mode) == 0o755
    modes = modes_under(store_path)
    assert any(p.startswith("packs") for p in modes) and "index.sqlite" in modes, sorted(modes)
    bad = {p: (kind, oct(mode)) for p, (kind, mode) in modes.items()
           if mode != (0o700 if kind == "dir" else 0o600)}
    assert not bad, bad
    assert stat.S_IMODE(os.stat(store_path).st_mode) == 0o700

    def try_all() -> list[str]:
        opened = []
        for rel in ["", *modes]:
            path = os.path.join(store_path, rel)
            try:
                if os.path.isdir(path):
                    os.listdir(path)
                else:
                    open(path, "rb").close()
                opened.append(rel)
            except PermissionError:
                pass
        return opened

    assert as_user(other_user, try_all) == {"value": []}


def test_helper_files_and_socket_modes(helper_up) -> None:
    """The socket is open to all (each request is authorized by the peer's credentials); what
    the helper keeps is root's alone; every user's work dir is theirs alone."""
    work = helper_up.work_dir

    def mode(path: str) -> tuple[int, int, int]:
        st = os.lstat(path)
        return st.st_uid, stat.S_IMODE(st.st_mode), stat.S_IFMT(st.st_mode)

    assert mode(helper_up.socket_path) == (0, 0o666, stat.S_IFSOCK)
    assert mode(os.path.dirname(helper_up.socket_path)) == (0, 0o755, stat.S_IFDIR)
    assert mode(work) == (0, 0o711, stat.S_IFDIR)
    for name, want in ((".staging", 0o700), (".nsinit", 0o711)):
        assert mode(os.path.join(work, name)) == (0, want, stat.S_IFDIR), name
    assert mode(os.path.join(work, ".nsinit", "nsinit.py")) == (0, 0o644, stat.S_IFREG)
    for entry in os.listdir(os.path.join(work, ".nsinit")):
        if entry.isdigit():  # each uid's inits' cwd: only root and the inits may write it
            st = os.lstat(os.path.join(work, ".nsinit", entry))
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) in ((0, 0o755), (0, 0o775)), entry
    assert mode(os.path.join(work, ".seal-key")) == (0, 0o600, stat.S_IFREG)
    assert mode(helper_up.socket_path + ".trees.json")[:2] == (0, 0o644)
    for entry in os.listdir(work):
        if entry.isdigit():
            assert mode(os.path.join(work, entry)) == (int(entry), 0o700, stat.S_IFDIR), entry


def test_protocol_version_is_checked_on_the_socket(helper_up) -> None:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(helper_up.socket_path)
        s.sendall(b'{"v": 2, "id": 1, "op": "hello", "args": {}}\n'
                  b'{"id": 2, "op": "hello", "args": {}}\n')
        data = b""
        while data.count(b"\n") < 2:
            data += s.recv(65536)
    replies = [json.loads(line) for line in data.splitlines()]
    assert [r["error"]["reason"] for r in replies] == ["protocol_version"] * 2
    assert "speaks protocol version 1" in replies[0]["error"]["message"]


ROUTES = [
    ("GET", "infinijup/status?kernel_id={kid}", None),
    ("GET", "infinijup/history?kernel_id={kid}", None),
    ("POST", "infinijup/snapshot", {"kernel_id": "{kid}"}),
    ("POST", "infinijup/restore", {"kernel_id": "{kid}", "commit": "main"}),
    ("POST", "infinijup/branch", {"kernel_id": "{kid}", "name": "attack"}),
    ("POST", "infinijup/resume", {"path": "x.ipynb", "commit": "main"}),
]


@pytest.fixture
def other_server(helper_up, other_user):
    """The second account's own Jupyter server (its own token, store and notebooks), as that
    account, on the same helper."""
    base = make_base()
    closed = checkout_closed_to(other_user)
    if closed:
        pytest.skip(closed)
    (base / "store-dir").mkdir()
    hub_secret = f"hub-secret-{os.urandom(8).hex()}"  # as JupyterHub would set them
    server = ServerProcess(base / "server", helper_up.socket_path, str(base / "store-dir" / "store"),
                           base / "server" / "notebooks", user=other_user,
                           extra_env={"JUPYTERHUB_API_TOKEN": hub_secret,
                                      "JPY_API_TOKEN": hub_secret})
    server.hub_secret = hub_secret
    server.start()
    yield server
    server.stop()
    import shutil

    shutil.rmtree(base, ignore_errors=True)


async def test_every_route_refuses_another_accounts_credentials(
        notebook, jp_serverapp, jp_base_url, jp_http_port, store_path, other_server, other_user):
    """Root's routes refuse the second account: its real token (of its own real server) gets
    403 on every Infinijup route of root's server, as do no credentials and a forged one;
    the second account's server does not know root's kernel (404); nothing happens to root's
    kernel or store."""
    nb = notebook
    await nb.execute("x = 1")
    first = await nb.snapshot()
    before = store_state(store_path)
    client = AsyncHTTPClient()
    token = jp_serverapp.identity_provider.token
    assert token and not jp_serverapp.allow_unauthenticated_access
    assert other_server.token != token

    async def call(method, route, body, headers):
        url = f"http://localhost:{jp_http_port}{jp_base_url}{route.format(kid=nb.kernel_id)}"
        data = None
        if body is not None:
            data = json.dumps({k: v.format(kid=nb.kernel_id) for k, v in body.items()})
        r = await client.fetch(url, method=method, body=data, headers=headers,
                               raise_error=False, follow_redirects=False)
        return r.code

    seen = {}
    for method, route, body in ROUTES:
        for who, headers in (
            ("the second account's own token", {"Authorization": f"token {other_server.token}"}),
            ("no credentials", {}),
            ("a forged token", {"Authorization": "token not-the-token"}),
        ):
            code = await call(method, route, body, headers)
            assert code == 403, (method, route, who, code)
        if "{kid}" in route or (body and "{kid}" in body.values()):
            seen[route] = await call(method, route.replace("{kid}", "no-such-kernel"), body and {
                k: ("no-such-kernel" if v == "{kid}" else v) for k, v in body.items()},
                {"Authorization": f"token {token}"})
    # with root's token the same routes answer (404 for the unknown kernel, not 403)
    assert set(seen.values()) == {404}, seen
    # the second account's server, with its own token, knows nothing of root's kernel
    for method, route, body in ROUTES[:5]:
        path = "/" + route.format(kid=nb.kernel_id)
        code, _ = other_server.request(method, path, body and {
            k: v.format(kid=nb.kernel_id) for k, v in body.items()})
        assert code == 404, (method, route, code)
    # and none of the refused requests did anything
    assert store_state(store_path) == before
    assert (await nb.history())["threads"] == {"main": first["commit"]}
    assert await nb.value("x") == 1


def test_second_account_snapshots_restores_and_branches_its_own_kernel(other_server,
                                                                       other_user):
    """A plain account's whole round trip, through its own real Jupyter server and the shared
    root helper, on this machine (whose root lacks CAP_SYS_RESOURCE): its kernel runs as it,
    snapshot, change, restore (the value comes back), branch, snapshot on the branch."""
    import psutil

    kernel_id = other_server.open_session("mine.ipynb")
    kernel = other_server.kernel_client(kernel_id)
    try:
        kernel.execute("import os\nx = 'first'\nme = os.getuid()")
        assert kernel.evaluate(me="me")["me"] == str(other_user.pw_uid)
        kernels = [p for p in psutil.process_iter(["cmdline", "uids"])
                   if any(f"kernel-{kernel_id}.json" in a for a in (p.info["cmdline"] or []))]
        assert kernels
        for proc in kernels:
            assert set(proc.info["uids"]) == {other_user.pw_uid}
            # the hub's and the server's credentials are not in the kernel (nor its snapshots)
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
            assert other_server.hub_secret.encode() not in environ
            assert other_server.token.encode() not in environ
        code, snap = other_server.request("POST", "/infinijup/snapshot", {"kernel_id": kernel_id})
        assert code == 201, snap
        kernel.execute("x = 'second'")
        code, done = other_server.request("POST", "/infinijup/restore",
                                          {"kernel_id": kernel_id, "commit": snap["commit"]})
        assert code == 200, done
        kernel.wait_answering()
        assert kernel.evaluate(x="x")["x"] == "'first'"
        code, br = other_server.request("POST", "/infinijup/branch",
                                        {"kernel_id": kernel_id, "name": "other-path"})
        assert code in (200, 201), br
        kernel.execute("x = 'on the branch'")
        code, snap2 = other_server.request("POST", "/infinijup/snapshot",
                                           {"kernel_id": kernel_id})
        assert code == 201 and snap2["thread"] == "other-path", snap2
        assert snap2["parents"] == [snap["commit"]]
        # resumed into a new kernel of theirs (the helper rewrites the images' endpoints for it)
        code, resumed = other_server.request("POST", "/infinijup/resume", {
            "path": "mine.ipynb", "commit": snap["commit"], "new_notebook": True})
        assert code == 200, resumed
        copy = other_server.kernel_client(resumed["kernel_id"])
        try:
            assert copy.evaluate(x="x")["x"] == "'first'"
        finally:
            copy.close()
        # the kernel's own %snapshot, signed with its message key, as the second account
        kernel.execute("%snapshot -w -m 'from the kernel'", timeout=120)
        code, hist = other_server.request("GET", f"/infinijup/history?kernel_id={kernel_id}")
        assert code == 200, hist
        assert [c["parents"] for c in hist["commits"] if c["message"] == "from the kernel"] == \
            [[snap2["commit"]]], hist
        store = Path(other_server.env["INFINIJUP_STORE"])
        assert all(st.st_uid == other_user.pw_uid for st in
                   (p.lstat() for p in [store, *store.rglob("*")]))
    finally:
        kernel.close()
        other_server.request("DELETE", f"/api/kernels/{kernel_id}")


BAD_BODIES = [
    ("snapshot", b"[1, 2]"),
    ("snapshot", b'"text"'),
    ("snapshot", b"\xff\xfe"),
    ("snapshot", b'{"kernel_id": 5}'),
    ("snapshot", b'{"kernel_id": ""}'),
    ("snapshot", b'{"kernel_id": "{kid}", "message": ["x"]}'),
    ("snapshot", b'{"kernel_id": "{kid}", "thread": "../../etc"}'),
    ("snapshot", b'{"kernel_id": "{kid}", "thread": "a--b"}'),
    ("snapshot", b'{"kernel_id": "{kid}", "thread": "' + b"a" * 100 + b'"}'),
    ("snapshot", b'{"kernel_id": "{kid}", "from_kernel": true, "request_id": "../x"}'),
    ("restore", b'{"kernel_id": "{kid}"}'),
    ("restore", b'{"kernel_id": "{kid}", "commit": "../../../etc/passwd"}'),
    ("restore", b'{"kernel_id": "{kid}", "commit": "' + b"f" * 5000 + b'"}'),
    ("restore", b'{"kernel_id": "{kid}", "commit": "abc"}'),
    ("restore", b'{"kernel_id": "{kid}", "commit": "main", "branch": "../x"}'),
    ("restore", b'{"kernel_id": "{kid}", "commit": {"$ne": 1}}'),
    ("branch", b'{"kernel_id": "{kid}", "name": "--"}'),
    ("branch", b'{"kernel_id": "{kid}", "name": "\\u0000"}'),
    ("branch", b'{"kernel_id": "{kid}"}'),
]


def test_kernels_sign_their_own_requests_and_nothing_else(helper_up):
    """The magics' requests carry no server token (kernel_auth.py): a kernel signs them with its
    message key, and the server accepts such a request only for that kernel, on Infinijup's
    routes, with a fresh signature over this very request."""
    import time

    from infinijup import kernel_auth

    base = make_base()
    server = ServerProcess(base / "server", helper_up.socket_path, str(base / "store"),
                           base / "notebooks")
    server.start()
    try:
        mine, theirs = server.open_session("mine.ipynb"), server.open_session("theirs.ipynb")
        kernel = server.kernel_client(mine)
        environ = "repr(dict(__import__('os').environ))"
        assert server.token not in kernel.evaluate(env=environ)["env"]
        kernel.execute("x = 1\n%snapshot -w -m signed", timeout=120)
        code, hist = server.request("GET", f"/infinijup/history?kernel_id={mine}")
        assert code == 200 and [c["message"] for c in hist["commits"]] == ["signed"], hist
        key = kernel.kc.session.key
        sibling = server.kernel_client(theirs)
        assert sibling.kc.session.key != key  # no key shared by a user's kernels
        sibling.close()

        def signed(method, path, body=None, kid=mine, key=key, ago=0.0, signed_body=None):
            raw = json.dumps(body).encode() if body is not None else b""
            header = kernel_auth.sign(key, kid, method, path,
                                      raw if signed_body is None else signed_body,
                                      time.time() - ago)
            return server.request(method, path, body, token="",
                                  headers={"Authorization": header})[0]

        assert signed("GET", f"/infinijup/status?kernel_id={mine}") == 200
        refused = {
            "another kernel's snapshot": signed("POST", "/infinijup/snapshot",
                                                {"kernel_id": theirs}),
            # each kernel session has a key of its own: this kernel cannot sign as its sibling
            "signed as the sibling": signed("POST", "/infinijup/snapshot",
                                            {"kernel_id": theirs}, kid=theirs),
            "the sibling's status": signed("GET", f"/infinijup/status?kernel_id={theirs}",
                                           kid=theirs),
            "another kernel's history": signed("GET", f"/infinijup/history?kernel_id={theirs}"),
            "starting kernels": signed("POST", "/infinijup/resume",
                                       {"path": "mine.ipynb", "commit": "main"}),
            "a wrong key": signed("GET", f"/infinijup/status?kernel_id={mine}", key=b"k" * 64),
            "an old signature": signed("GET", f"/infinijup/status?kernel_id={mine}", ago=3600),
            "another body": signed("POST", "/infinijup/snapshot", {"kernel_id": mine},
                                   signed_body=b'{"kernel_id": "x"}'),
            "a kernel that is not running": signed("GET", "/infinijup/status?kernel_id=nope",
                                                   kid="nope"),
            "Jupyter's own routes": signed("GET", "/api/kernels"),
        }
        assert set(refused.values()) == {403}, refused
        code, hist = server.request("GET", f"/infinijup/history?kernel_id={mine}")
        assert [c["message"] for c in hist["commits"]] == ["signed"], hist
        kernel.close()
    finally:
        server.stop()


async def test_malformed_rest_requests_get_4xx(notebook, store_path):
    nb = notebook
    await nb.execute("x = 1")
    await nb.snapshot()
    before = store_state(store_path)
    for route, raw in BAD_BODIES:
        body = raw.replace(b"{kid}", nb.kernel_id.encode())
        r = await nb.fetch("infinijup", route, method="POST", body=body, raise_error=False)
        assert 400 <= r.code < 500, (route, raw, r.code, r.body)
        if r.code != 403:
            assert set(json.loads(r.body)) == {"message", "reason"}, r.body
    for query in ({"kernel_id": "x" * 5000}, {"path": "../../etc/passwd"}, {}):
        r = await nb.fetch("infinijup", "history", params=query, raise_error=False)
        assert r.code in (200, 400, 404), (query, r.code)
        if r.code == 200:
            assert json.loads(r.body)["commits"] == []
    assert store_state(store_path) == before
    assert await nb.value("x") == 1
