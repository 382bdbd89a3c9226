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

from jupyter_server.services.kernels.connection.base import (
    deserialize_binary_message,
    deserialize_msg_from_ws_v1,
    serialize_msg_to_ws_v1,
)
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection

V1 = "v1.kernel.websocket.jupyter.org"


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
        await super().prepare()

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

    def handle_incoming_message(self, incoming_msg) -> None:
        hibernation = self.hibernation
        if hibernation is None or (not hibernation.holds(self.kernel_id) and self._held is None):
            return super().handle_incoming_message(incoming_msg)
        channel, header = self._parse(incoming_msg)
        if self._held is None:
            self._held = []
        self._held.append((incoming_msg, channel, header))
        if header.get("msg_type") != "kernel_info_request":
            wake = hibernation.wake_soon(self.kernel_id)
            wake.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen in held_done

    def held_done(self, error: str | None) -> None:
        """The kernel's rest is over (``error`` None) or it could not wake (``error``)."""
        held, self._held = self._held or [], None
        if error is not None:
            for _raw, channel, header in held:
                if channel in ("shell", "control") and \
                        header.get("msg_type", "").endswith("_request"):
                    self._answer_with_error(channel, header, error)
            return
        if not held:
            return
        # The woken kernel publishes on IOPub before this websocket's subscription is back
        # (it reconnects on its own): outputs of the held requests would be lost. jupyter's
        # nudge proves the subscription; then the requests go, in their order.
        self._held = []  # anything arriving meanwhile queues behind them
        nudged = super().nudge()

        def send(_future) -> None:
            for stream in self.channels.values():
                if not stream.closed():
                    stream.on_recv_stream(self.handle_outgoing_message)
            queued, self._held = held + (self._held or []), None
            for raw, _channel, _header in queued:
                super(RestingKernelConnection, self).handle_incoming_message(raw)

        nudged.add_done_callback(send)

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
