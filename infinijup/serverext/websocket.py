"""The kernel websocket of a notebook, holding its requests while the kernel rests.

jupyter_server's own connection class, plus: while ``Hibernation.holds`` the kernel, requests
from the notebook are kept here in order, and the first one that is not a
``kernel_info_request`` wakes the kernel. Once it is awake they go to it as if just sent; if it
cannot wake, each is answered with an error that says why (nothing runs twice, nothing is
dropped silently).
"""

from __future__ import annotations

import asyncio
import json
import time

from jupyter_server.services.kernels.connection.base import (
    deserialize_binary_message,
    deserialize_msg_from_ws_v1,
    serialize_msg_to_ws_v1,
)
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection

from ..engine.lifecycle import RESTORING

V1 = "v1.kernel.websocket.jupyter.org"

# What a resting kernel (hibernated, or with its GPU memory released) is asked, and what happens
# (docs/api.md has the table). Answered from what it last said while awake, without waking it:
#   kernel_info_request -> its last kernel_info_reply (Lab asks on every tab switch)
#   comm_info_request   -> its last comm_info_reply (the comms are in its snapshot)
#   debug_request debugInfo -> its last answer (the debugger panel asks on focus)
#   interrupt_request   -> ok (nothing runs in a resting kernel)
# Each of these is held instead, and answered once the kernel wakes, where it never said it.
# Everything else wakes it: execute, complete, inspect, is_complete, history, input replies,
# comm messages, every other debug_request (a debugging session the user starts).
REMEMBERED = ("kernel_info_reply", "comm_info_reply", "debug_reply")
WAIT_WITHOUT_WAKING = ("kernel_info_request", "comm_info_request")


def remembered_key(reply_type: str, content: dict) -> str | None:
    if reply_type == "debug_reply":
        return "debug:debugInfo" if content.get("command") == "debugInfo" else None
    if content.get("status", "ok") != "ok":
        return None
    return reply_type[: -len("_reply")]


def resting_answer(known: dict, request: str, content: dict) -> tuple[str, dict] | None:
    """(reply type, content) for a request a resting kernel can answer; None: it must wake."""
    if request == "interrupt_request":
        return "interrupt_reply", {"status": "ok"}
    if request == "debug_request":
        said = known.get("debug:debugInfo") if content.get("command") == "debugInfo" else None
        if said is None:
            return None
        return "debug_reply", {**said, "request_seq": content.get("seq", said.get("request_seq"))}
    said = known.get(request[: -len("_request")]) if request.endswith("_request") else None
    if request in WAIT_WITHOUT_WAKING and said is not None:
        return request[: -len("_request")] + "_reply", said
    return None


class RestingKernelConnection(ZMQChannelsWebsocketConnection):
    """A kernel websocket connection that holds requests while its kernel rests."""

    _held: list | None = None

    @property
    def hibernation(self):
        manager = self.websocket_handler.settings.get("infinijup_manager")
        return manager.hibernation if manager is not None else None

    async def prepare(self) -> None:
        if self.hibernation is not None:
            await self.hibernation.claim_record(self.kernel_id)
            await self._after_restore()
        await super().prepare()

    async def _after_restore(self) -> None:
        """A websocket opened while a restore replaces the kernel's process (a notebook whose
        kernel a resume just started, as Lab connects it) waits for the restore to end:
        jupyter_server's ``prepare`` asks the kernel for its kernel_info and waits up to
        ``kernel_info_timeout`` (60 s) for an answer that neither the process being replaced
        nor the restored one, still signing with its snapshot's key, gives. A kernel a resume
        started waits so from its start, not only once its restore has begun."""
        m = self.websocket_handler.settings["infinijup_manager"]

        def restoring() -> bool:
            return self.kernel_id in m.resumes.starting or \
                m.lifecycle.state(self.kernel_id) == RESTORING

        if not restoring():
            return
        m.log.info("infinijup: a websocket of kernel %s waits for its restore", self.kernel_id)
        deadline = time.monotonic() + self.kernel_info_timeout
        while restoring() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def connect(self):
        if self.hibernation is not None:
            self.hibernation.listeners.setdefault(self.kernel_id, set()).add(self)
        return super().connect()

    def disconnect(self):
        if self.hibernation is not None:
            self.hibernation.listeners.get(self.kernel_id, set()).discard(self)
        return super().disconnect()

    def nudge(self):
        # A resting kernel answers nothing: do not make the notebook wait for it to.
        if self.hibernation is not None and self.hibernation.holds(self.kernel_id):
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        return super().nudge()

    def handle_outgoing_message(self, stream, outgoing_msg) -> None:
        try:
            super().handle_outgoing_message(stream, outgoing_msg)
        except ValueError as exc:
            # A kernel restored into this session signs with its snapshot's key until it is
            # given this session's (engine/retarget.py): drop such a message, keep the channel.
            self.log.debug("infinijup: dropped a message of kernel %s: %s", self.kernel_id, exc)
            return
        channel = stream if isinstance(stream, str) else getattr(stream, "channel", None)
        if channel in ("shell", "control") and self.hibernation is not None:
            self._remember(outgoing_msg)

    def handle_incoming_message(self, incoming_msg) -> None:
        hibernation = self.hibernation
        if hibernation is None or (not hibernation.holds(self.kernel_id) and self._held is None):
            return super().handle_incoming_message(incoming_msg)
        channel, header = self._parse(incoming_msg)
        if hibernation.holds(self.kernel_id) and self._held is None:
            answer = resting_answer(hibernation.known.get(self.kernel_id, {}),
                                    header.get("msg_type", ""), self._content(incoming_msg))
            if answer is not None:  # nothing to compute: answered from what it knew
                self._answer(channel, header, *answer)
                return
        if self._held is None:
            self._held = []
        self._held.append((incoming_msg, channel, header))
        if header.get("msg_type") not in WAIT_WITHOUT_WAKING:
            wake = hibernation.wake_soon(self.kernel_id)
            wake.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen in held_done

    def held_done(self, error: str | None, came_back: bool = False) -> None:
        """The kernel's rest is over (``error`` None) or it could not wake (``error``).
        ``came_back``: it has a process again (a wake, or a restore of a resting kernel):
        even with nothing held, what comes now waits until this websocket's IOPub subscription
        has reached the new process, or its outputs would go to nobody."""
        held, self._held = self._held or [], None
        if error is not None:
            for _raw, channel, header in held:
                if channel in ("shell", "control") and \
                        header.get("msg_type", "").endswith("_request"):
                    self._answer_with_error(channel, header, error)
            return
        if not held and not came_back:
            return
        self._held = []  # anything arriving meanwhile queues behind them

        def send(_future) -> None:
            for stream in self.channels.values():
                if not stream.closed():
                    stream.on_recv_stream(self.handle_outgoing_message)
            queued, self._held = held + (self._held or []), None
            for raw, _channel, _header in queued:
                super(RestingKernelConnection, self).handle_incoming_message(raw)

        asyncio.ensure_future(self._subscribed()).add_done_callback(send)

    async def _subscribed(self) -> None:
        """Return once this websocket's IOPub subscription to the woken kernel is back (it
        reconnects on its own, and a kernel publishes to nobody until it is): otherwise the
        outputs and the idle status of the held requests could be lost. Like jupyter's nudge,
        kernel_info requests on a channel of our own until an IOPub message arrives, but also
        when the server believes the kernel busy (jupyter's nudge skips those; a kernel just
        woken may seem busy only because the idle status of a request of the restore went to
        nobody, and the held requests would go out unproven)."""
        iopub = self.channels.get("iopub")
        if iopub is None or iopub.closed():
            return
        shell = self.kernel_manager.connect_shell()
        seen = asyncio.get_running_loop().create_future()

        def on_iopub(_msg) -> None:
            if not seen.done():
                seen.set_result(None)

        iopub.on_recv(on_iopub)
        shell.on_recv(lambda _msg: None)
        deadline = time.monotonic() + self.kernel_info_timeout
        try:
            while not seen.done() and time.monotonic() < deadline and not shell.closed():
                self.session.send(shell, "kernel_info_request")
                await asyncio.wait([seen], timeout=0.5)
        finally:
            if not iopub.closed():
                iopub.stop_on_recv()
            shell.close()

    # --- helpers ------------------------------------------------------------------------------
    def _parse(self, incoming_msg) -> tuple[str, dict]:
        try:
            if self.subprotocol == V1:
                channel, msg_list = deserialize_msg_from_ws_v1(incoming_msg)
                return channel or "shell", self.session.unpack(msg_list[0])
            msg = (deserialize_binary_message(incoming_msg) if isinstance(incoming_msg, bytes)
                   else json.loads(incoming_msg))
            return msg.get("channel") or "shell", msg.get("header") or {}
        except Exception:
            return "shell", {}

    def _content(self, incoming_msg) -> dict:
        try:
            if self.subprotocol == V1:
                _channel, msg_list = deserialize_msg_from_ws_v1(incoming_msg)
                return self.session.unpack(msg_list[3])
            msg = (deserialize_binary_message(incoming_msg) if isinstance(incoming_msg, bytes)
                   else json.loads(incoming_msg))
            return msg.get("content") or {}
        except Exception:
            return {}

    def _remember(self, outgoing_msg) -> None:
        """Keep the kernel's latest answers to what needs no computation (resting_answer)."""
        try:
            _idents, parts = self.session.feed_identities(outgoing_msg)
            header = self.session.unpack(bytes(parts[1]))
            if header.get("msg_type") not in REMEMBERED:
                return
            content = self.session.unpack(bytes(parts[4]))
        except Exception:
            return
        key = remembered_key(header["msg_type"], content)
        if key is not None:
            self.hibernation.known.setdefault(self.kernel_id, {})[key] = content

    def _answer(self, channel: str, parent: dict, reply_type: str, content: dict) -> None:
        """What the kernel would send: busy, the reply, idle."""
        for msg_type, body, on in (("status", {"execution_state": "busy"}, "iopub"),
                                   (reply_type, content, channel),
                                   ("status", {"execution_state": "idle"}, "iopub")):
            self._send(self.session.msg(msg_type, content=body, parent=parent), on)

    def _answer_with_error(self, channel: str, parent: dict, error: str) -> None:
        request = parent.get("msg_type", "")
        reply_type = request[: -len("_request")] + "_reply"
        content = {"status": "error", "ename": "KernelNotAwake", "evalue": error,
                   "traceback": [error]}
        # what a kernel would send: busy, the error, the reply, idle (a notebook marks the
        # cell done only with both the reply and the idle status)
        self._send(self.session.msg("status", content={"execution_state": "busy"},
                                    parent=parent), "iopub")
        if request == "execute_request":
            content["execution_count"] = None
            self._send(self.session.msg("error", content={k: content[k] for k in
                                                          ("ename", "evalue", "traceback")},
                                        parent=parent), "iopub")
        self._send(self.session.msg(reply_type, content=content, parent=parent), channel)
        self._send(self.session.msg("status", content={"execution_state": "idle"},
                                    parent=parent), "iopub")

    def _send(self, msg: dict, channel: str) -> None:
        try:
            if self.subprotocol == V1:
                parts = self.session.serialize(msg)[2:]  # without delimiter and signature
                self.write_message(serialize_msg_to_ws_v1(parts, channel), binary=True)
            else:
                self.write_message(self._reserialize_reply({**msg, "buffers": []},
                                                           channel=channel))
        except Exception as exc:  # a closed websocket: nobody is left to tell
            self.log.warning("infinijup: could not answer a held request: %s", exc)
