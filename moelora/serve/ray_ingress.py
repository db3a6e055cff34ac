"""The ingress of moelora's Ray Serve application (serve/ray.py): an ASGI app behind Ray's
HTTP proxy that reads a request's body, names its adapter as Ray Serve's multiplexed model
id when its `model` is one of --lora-modules (Ray's router then picks a replica holding
it), and sends back the engine replica's ASGI messages as they come. It reads no more body
than a replica's app would (the replica then answers 413), and answers 503 itself only when
no replica answered at all.
"""

from __future__ import annotations

import json
import logging

from .asgi_call import HttpRequest
from .protocol import error_body

log = logging.getLogger("moelora.serve")

# The routes whose body names the model (and so the adapter) a request runs.
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


class Relay:
    """The ingress's ASGI app: the body read (at most what a replica's app reads), the
    multiplexed model id named after a --lora-modules adapter in its `model`, and the
    engine replica's ASGI messages sent back as they come."""

    def __init__(self, adapters: frozenset[str], engine: str) -> None:
        self.adapters, self.engine = adapters, engine
        self._handle = None
        self._max_body: int | None = None

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        if scope["type"] != "http":
            return None
        engine = self._engine_handle()
        if self._max_body is None:
            self._max_body = await engine.max_body_bytes.remote()
        body = await _read(receive, self._max_body)
        if body is None:
            return None  # the client left before its body was whole
        request = HttpRequest.of(scope, body)
        options: dict = {"stream": True}
        model = _model_of(request)
        if model in self.adapters:
            options["multiplexed_model_id"] = model
        started = False
        try:
            async for message in engine.options(**options).relay.remote(request):
                started = started or message["type"] == "http.response.start"
                await send(message)
        except Exception as err:  # no replica answered (one died, Ray is shutting down, ...)
            if started:
                raise
            log.warning("ingress: %s %s found no replica: %r", request.method, request.path, err)
            for message in error_messages(503, f"no engine replica answered: {err}",
                                  "ServiceUnavailableError", None, []):  # fmt: skip
                await send(message)

    def _engine_handle(self):
        """The engine deployment's handle in this ingress replica's application (Ray's way
        for an ASGI app to reach another deployment)."""
        if self._handle is None:
            from ray import serve

            app = serve.get_replica_context().app_name
            self._handle = serve.get_deployment_handle(self.engine, app_name=app)
        return self._handle


def _model_of(request: HttpRequest) -> str | None:
    """The `model` a generation request's JSON body names (None for anything else: the
    replica that gets it answers, refusals included)."""
    if request.method != "POST" or request.path not in GENERATION_ROUTES:
        return None
    try:
        body = json.loads(request.body)
    except (ValueError, UnicodeDecodeError):
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


async def _read(receive, max_bytes: int) -> bytes | None:
    """The request body, cut one byte past `max_bytes` (the replica's app answers 413 to
    it), or None when the client leaves first."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        size += len(parts[-1])
        if size > max_bytes or not message.get("more_body", False):
            return b"".join(parts)[: max_bytes + 1]


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def error_messages(status: int, message: str, kind: str, param: str | None,
           headers: list[tuple[bytes, bytes]]) -> list[dict]:  # fmt: skip
    """An OpenAI error body as ASGI messages."""
    body = json.dumps(error_body(message, kind, status, param)).encode()
    start = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    return [{"type": "http.response.start", "status": status, "headers": start + headers},
            {"type": "http.response.body", "body": body, "more_body": False}]  # fmt: skip
