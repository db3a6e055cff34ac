"""One HTTP request through an ASGI app inside this process, without a server: the request
as plain picklable data (`HttpRequest`, what a Ray Serve ingress hands a replica), and
`call()`, which runs the app on it and yields the messages the app sends, as they come
(`http.response.start`, then the `http.response.body` parts: a stream stays a stream).

Closing the iterator early is the client leaving: the app's receive() then answers
`http.disconnect` (moelora's app frees the request's rows at the next step) and the app's
task is cancelled if it has not ended a moment later. Imports nothing of the HTTP stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("moelora.serve")

Message = dict[str, Any]
ASGIApp = Callable[[dict, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
                   Awaitable[None]]  # fmt: skip

# Seconds an app has to end on its own after its client left (it reads http.disconnect),
# before its task is cancelled: moelora's app polls the connection every 0.5 s.
SETTLE_S = 1.0


@dataclass(frozen=True)
class HttpRequest:
    """An HTTP request read whole: what an ASGI scope and its body say, as plain data."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()  # lower-case names, as ASGI gives them
    body: bytes = b""
    root_path: str = ""
    client: tuple[str, int] | None = None

    @classmethod
    def of(cls, scope: dict, body: bytes) -> HttpRequest:
        client = scope.get("client")
        return cls(scope["method"], scope["path"], scope.get("query_string", b""),
                   tuple((bytes(k), bytes(v)) for k, v in scope.get("headers", ())), body,
                   scope.get("root_path", ""), None if client is None else tuple(client))  # fmt: skip

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)

    def scope(self) -> dict:
        return {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": self.method, "scheme": "http",
            "path": self.path, "raw_path": self.path.encode(), "root_path": self.root_path,
            "query_string": self.query_string, "headers": list(self.headers),
            "client": self.client, "server": None, "state": {},
        }  # fmt: skip


async def call(app: ASGIApp, request: HttpRequest) -> AsyncIterator[Message]:
    """Run `app` on `request`; yield each message it sends until the response's last body
    part. An app that fails before answering raises its error here."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    left = asyncio.Event()
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await left.wait()  # the body was whole: the next message is the client leaving
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    task = asyncio.ensure_future(app(request.scope(), receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    answered = False
    try:
        while (message := await sent.get()) is not None:
            answered = answered or message["type"] == "http.response.start"
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body"):
                break
    finally:
        left.set()
        await _settle(task, answered)


async def _settle(task: asyncio.Future, answered: bool) -> None:
    """Let the app end (cancelled after SETTLE_S); its error is raised if it never answered,
    else logged (Starlette re-raises an error after it has sent the 500 it answered)."""
    done, _ = await asyncio.wait({task}, timeout=SETTLE_S)
    if not done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return
    error = None if task.cancelled() else task.exception()
    if error is None:
        return
    if not answered:
        raise error
    log.debug("the app raised after answering: %r", error)
