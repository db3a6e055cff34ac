"""What bounds one connection's cost before the app reads it: the request body's size and
the time a client may take to send its request.

- `BodyLimit` (ASGI middleware): a body past `max_bytes` is answered 413 (from its
  Content-Length before any byte is read, else as soon as the bytes received pass it), and a
  body whose next part takes longer than `read_timeout_s` is answered 408; both as OpenAI
  error bodies. The body is read here, then handed to the app whole.
- `timed_h11(head_timeout_s)`: uvicorn's h11 protocol with a deadline for a request's head
  (request line and headers) on a new or kept-alive connection; a connection that has not
  sent a whole head by then is closed (uvicorn itself waits forever for a first request).
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import error_body


def body_limit(max_model_len: int) -> int:
    """The largest request body the server reads: 1 MiB of fields and messages, and 64 bytes
    per token of --max-model-len (a token is a few characters; JSON escapes take up to 12
    bytes per character): room for any prompt the engine could run, not for 10 MB of text."""
    return (1 << 20) + 64 * max_model_len


class BodyLimit:
    def __init__(self, app, max_bytes: int, read_timeout_s: float = 30.0) -> None:
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(send, 413, int(length))
        parts, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except asyncio.TimeoutError:
                return await self._refuse(send, 408, size)
            if message["type"] == "http.disconnect":
                return None  # the client left before its body was whole: nothing to answer
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_bytes:
                return await self._refuse(send, 413, size)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(parts), "more_body": False}
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return whole
            return await receive()  # after the body: http.disconnect when the client leaves

        return await self.app(scope, replay, send)

    async def _refuse(self, send, status: int, size: int) -> None:
        if status == 413:
            message = (f"request body of {size} bytes or more is larger than this server's "
                       f"limit of {self.max_bytes} bytes: expected a smaller prompt (the limit "
                       "follows --max-model-len)")  # fmt: skip
            kind = "RequestTooLargeError"
        else:
            message = (f"the request body was not received in time (no data for "
                       f"{self.read_timeout_s:g} s after {size} bytes)")  # fmt: skip
            kind = "RequestTimeoutError"
        body = json.dumps(error_body(message, kind, status, "body")).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]  # fmt: skip
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def timed_h11(head_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol closing a connection whose request head has not arrived within
    `head_timeout_s` of the connection opening or of its last response."""

    class TimedH11(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_timer()

        def _arm_head_timer(self) -> None:
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_late)

        def _head_late(self) -> None:
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # no whole request head in time: a slow or idle client

        def connection_lost(self, exc) -> None:
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

    return TimedH11
