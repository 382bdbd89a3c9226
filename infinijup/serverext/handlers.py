"""HTTP for the snapshot manager: parse, one awaited call, JSON out. No logic lives here."""

from __future__ import annotations

import functools
import json
import re
import time

import tornado.web
from jupyter_server.auth import User
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.call_context import CallContext
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from .. import kernel_auth
from ..errors import BadRequest, InfinijupError
from . import space

_REQUEST_ID = re.compile(r"^[0-9a-f]{32}$")


class InfinijupHandler(APIHandler):
    """Base handler: domain errors become ``{"message", "reason"}`` with the right status."""

    auth_resource = "infinijup"
    signed_kernel: str | None = None  # the kernel that signed this request (kernel_auth.py)

    @property
    def manager(self):
        return self.settings["infinijup_manager"]

    async def prepare(self) -> None:
        header = self.request.headers.get("Authorization", "")
        if not header.startswith(kernel_auth.SCHEME + " "):
            return await super().prepare()
        # A kernel's own request (%snapshot and friends), signed with its message key. It may
        # act on that kernel only (``own_kernel``); no cookie is involved, so no XSRF check.
        CallContext.set(CallContext.JUPYTER_HANDLER, self)
        if not self.check_host():
            raise tornado.web.HTTPError(403)
        claimed = kernel_auth.claimed_kernel(header)
        key = self.manager.kernel_message_key(claimed) if claimed else None
        if key is None:
            raise tornado.web.HTTPError(403, "the signing kernel is not running on this server")
        try:
            self.signed_kernel = kernel_auth.verify(key, header, self.request.method or "",
                                                    self.request.uri or "", self.request.body or b"",
                                                    time.time())
        except kernel_auth.BadSignature as exc:
            raise tornado.web.HTTPError(403, str(exc)) from None
        self._token_authenticated = True
        self.current_user = self._jupyter_current_user = User(username=f"kernel-{claimed}")

    def own_kernel(self, kernel_id: str | None) -> None:
        """A signed kernel's request may only name that kernel."""
        if self.signed_kernel is not None and kernel_id != self.signed_kernel:
            raise tornado.web.HTTPError(403, "a kernel may only act on itself")

    def write_error(self, status_code: int, **kwargs) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, InfinijupError):
            body = {"message": exc.message, "reason": exc.reason}
        elif isinstance(exc, tornado.web.HTTPError):
            body = {"message": exc.log_message or self._reason, "reason": "http_error"}
        else:
            body = {"message": self._reason, "reason": "internal_error"}
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))

    def body(self) -> dict:
        try:
            data = json.loads(self.request.body or b"{}")
        except ValueError:
            raise BadRequest("the request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise BadRequest("the request body must be a JSON object")
        return data

    async def call(self, coro, status: int = 200) -> None:
        try:
            result = await coro
        except InfinijupError as exc:
            self.log.info("infinijup: %s (%s)", exc.message, exc.reason)
            self.send_error(exc.http_status, exc_info=(type(exc), exc, exc.__traceback__))
            return
        self.set_status(status)
        self.finish(json.dumps(result))


def allowed(method):
    """``@authorized`` for users; a request signed by one of this server's kernels is the
    server owner's own code acting on that kernel (``own_kernel``), so it skips the authorizer."""
    checked = authorized(method)

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.signed_kernel is not None:
            return method(self, *args, **kwargs)
        return checked(self, *args, **kwargs)

    return wrapper


def _str(body: dict, name: str, *, required: bool = False) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise BadRequest(f"'{name}' is required")
        return None
    if not isinstance(value, str) or not value:
        raise BadRequest(f"'{name}' must be a non-empty string")
    return value


class SnapshotHandler(InfinijupHandler):
    @tornado.web.authenticated
    @allowed
    async def post(self) -> None:
        try:
            body = self.body()
            kernel_id = _str(body, "kernel_id", required=True)
            self.own_kernel(kernel_id)
            message = body.get("message") or ""
            if not isinstance(message, str):
                raise BadRequest("'message' must be a string")
            thread = _str(body, "thread")
            request_id = _str(body, "request_id")
            described = body.get("metadata")  # %snapshot's description of the kernel
            if described is not None and not isinstance(described, dict):
                raise BadRequest("'metadata' must be an object")
        except InfinijupError as exc:
            return await self.call(_raise(exc))
        if body.get("from_kernel"):
            if request_id is None or not _REQUEST_ID.match(request_id):
                return await self.call(_raise(BadRequest("'request_id' must be 32 hex digits")))
            return await self.call(self.manager.snapshot_for_kernel(
                kernel_id, message, thread, request_id, body.get("execution_count"), described),
                status=202)
        await self.call(self.manager.snapshot(kernel_id, message=message, thread=thread), status=201)


class RestoreHandler(InfinijupHandler):
    @tornado.web.authenticated
    @allowed
    async def post(self) -> None:
        try:
            body = self.body()
            kernel_id = _str(body, "kernel_id", required=True)
            self.own_kernel(kernel_id)
            ref = _str(body, "commit", required=True)
            branch = _str(body, "branch")
        except InfinijupError as exc:
            return await self.call(_raise(exc))
        if body.get("from_kernel"):
            return await self.call(self.manager.restore_for_kernel(kernel_id, ref, branch), status=202)
        force = bool(body.get("force", False))
        gpu_map = body.get("gpu_map")
        if gpu_map is not None and not (
            isinstance(gpu_map, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in gpu_map.items())
        ):
            return await self.call(_raise(BadRequest("'gpu_map' must map GPU UUIDs to GPU UUIDs")))
        await self.call(self.manager.restore(kernel_id, ref, branch=branch, force=force,
                                             gpu_map=gpu_map))


class ResumeHandler(InfinijupHandler):
    @tornado.web.authenticated
    @allowed
    async def post(self) -> None:
        try:
            body = self.body()
            self.own_kernel(None)  # starts kernels: never a kernel's own request
            path = _str(body, "path", required=True)
            ref = _str(body, "commit", required=True)
            kernel_name = _str(body, "kernel_name")
        except InfinijupError as exc:
            return await self.call(_raise(exc))
        await self.call(self.manager.resume(path, ref, kernel_name=kernel_name,
                                            new_notebook=bool(body.get("new_notebook", False)),
                                            force=bool(body.get("force", False)),
                                            session=body.get("session", True) is not False))


class BranchHandler(InfinijupHandler):
    @tornado.web.authenticated
    @allowed
    async def post(self) -> None:
        try:
            body = self.body()
            kernel_id = _str(body, "kernel_id", required=True)
            self.own_kernel(kernel_id)
            name = _str(body, "name", required=True)
        except InfinijupError as exc:
            return await self.call(_raise(exc))
        await self.call(self.manager.branch(kernel_id, name))


class HibernateHandler(InfinijupHandler):
    @tornado.web.authenticated
    @allowed
    async def post(self) -> None:
        try:
            body = self.body()
            kernel_id = _str(body, "kernel_id", required=True)
            self.own_kernel(kernel_id)
        except InfinijupError as exc:
            return await self.call(_raise(exc))
        from_kernel = bool(body.get("from_kernel"))
        await self.call(self.manager.hibernate(kernel_id, from_kernel=from_kernel),
                        status=202 if from_kernel else 200)


class KernelActionHandler(InfinijupHandler):
    """POST {"kernel_id"}: one call of the manager's ``action`` on that kernel."""

    action = ""

    @tornado.web.authenticated
    @allowed
    async def post(self) -> None:
        try:
            kernel_id = _str(self.body(), "kernel_id", required=True)
            self.own_kernel(kernel_id)
        except InfinijupError as exc:
            return await self.call(_raise(exc))
        await self.call(getattr(self.manager, self.action)(kernel_id))


class ReleaseHandler(KernelActionHandler):
    action = "release"


class MakeRoomHandler(InfinijupHandler):
    """POST {"kernel_id", "bytes", "gpu"}: a running kernel's allocation found no room
    (manager.make_room); the kernel itself asks, signed with its key."""

    @tornado.web.authenticated
    @allowed
    async def post(self) -> None:
        try:
            body = self.body()
            kernel_id = _str(body, "kernel_id", required=True)
            gpu = _str(body, "gpu", required=True)
            nbytes = body.get("bytes")
            if type(nbytes) is not int or nbytes <= 0:
                raise BadRequest("'bytes' must be a positive integer")
            self.own_kernel(kernel_id)
        except InfinijupError as exc:
            return await self.call(_raise(exc))
        await self.call(self.manager.make_room(kernel_id, nbytes, gpu))


class CancelHandler(KernelActionHandler):
    """POST {"kernel_id"}: give up what waits for the busy kernel (manager.cancel)."""

    action = "cancel"


class WakeHandler(KernelActionHandler):
    action = "wake"


class UndoHandler(InfinijupHandler):
    """POST {"kernel_id", "from_kernel"?}: undo.py's undo (or redo, ``action``); from the
    kernel itself (``%undo``), once the asking cell is done (202)."""

    action = "undo"

    @tornado.web.authenticated
    @allowed
    async def post(self) -> None:
        try:
            body = self.body()
            kernel_id = _str(body, "kernel_id", required=True)
            self.own_kernel(kernel_id)
        except InfinijupError as exc:
            return await self.call(_raise(exc))
        from_kernel = bool(body.get("from_kernel"))
        run = getattr(self.manager.undo_redo, self.action)
        await self.call(run(kernel_id, from_kernel=from_kernel), status=202 if from_kernel else 200)


class RedoHandler(UndoHandler):
    action = "redo"


class AutosnapshotHandler(InfinijupHandler):
    """POST {"kernel_id", "on"?}: turn a kernel's automatic snapshots on or off (without
    "on": only say how they are)."""

    @tornado.web.authenticated
    @allowed
    async def post(self) -> None:
        try:
            body = self.body()
            kernel_id = _str(body, "kernel_id", required=True)
            self.own_kernel(kernel_id)
            on = body.get("on")
            if on is not None and not isinstance(on, bool):
                raise BadRequest("'on' must be true or false")
        except InfinijupError as exc:
            return await self.call(_raise(exc))
        await self.call(self.manager.kernel_autosnapshot(kernel_id, on))


class HistoryHandler(InfinijupHandler):
    @tornado.web.authenticated
    @allowed
    async def get(self) -> None:
        kernel_id = self.get_argument("kernel_id", None)
        self.own_kernel(kernel_id)
        path = self.get_argument("path", None)
        await self.call(self.manager.history(kernel_id=kernel_id, path=path))


class StatusHandler(InfinijupHandler):
    @tornado.web.authenticated
    @allowed
    async def get(self) -> None:
        kernel_id = self.get_argument("kernel_id", None)
        self.own_kernel(kernel_id)
        await self.call(self.manager.status(kernel_id))


class DeleteHandler(InfinijupHandler):
    """POST {"kernel_id" or "path", "commit" or "thread"}: delete from the notebook's history
    (space.py); 409 with the reason when something still needs it."""

    @tornado.web.authenticated
    @allowed
    async def post(self) -> None:
        try:
            body = self.body()
            self.own_kernel(None)  # never a kernel's own request
            kernel_id, path = _str(body, "kernel_id"), _str(body, "path")
            commit, thread = _str(body, "commit"), _str(body, "thread")
        except InfinijupError as exc:
            return await self.call(_raise(exc))
        await self.call(space.delete_snapshot_or_thread(
            self.manager, kernel_id=kernel_id, path=path, commit=commit, thread=thread))


class StatsHandler(InfinijupHandler):
    """GET: the store's and the hot tier's sizes."""

    @tornado.web.authenticated
    @allowed
    async def get(self) -> None:
        self.own_kernel(None)
        await self.call(space.stats(self.manager))


async def _raise(exc: Exception):
    raise exc


def setup_handlers(web_app) -> None:
    base = web_app.settings["base_url"]
    routes = [
        ("snapshot", SnapshotHandler),
        ("restore", RestoreHandler),
        ("resume", ResumeHandler),
        ("branch", BranchHandler),
        ("hibernate", HibernateHandler),
        ("release", ReleaseHandler),
        ("wake", WakeHandler),
        ("cancel", CancelHandler),
        ("make-room", MakeRoomHandler),
        ("history", HistoryHandler),
        ("status", StatusHandler),
        ("delete", DeleteHandler),
        ("stats", StatsHandler),
        ("undo", UndoHandler),
        ("redo", RedoHandler),
        ("autosnapshot", AutosnapshotHandler),
    ]
    web_app.add_handlers(".*$", [(url_path_join(base, "infinijup", name), h) for name, h in routes])
