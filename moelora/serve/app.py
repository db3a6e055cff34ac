"""The ASGI app (FastAPI): OpenAI's completions, chat completions and models routes, vLLM's
runtime adapter routes, /health and Prometheus /metrics, over one ServeContext.

Every refusal is an OpenAI error body ({"error": {message, type, param, code}}): 400 a
malformed body or field, 401 a wrong or missing API key, 403 runtime loading while it is
off, 404 an unknown model or adapter.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..errors import MoeloraError
from . import protocol
from .context import ServeContext, ServeError
from .generation import Generation, answer


def build_app(ctx: ServeContext, shutdown_grace_s: float = 30.0) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # uvicorn has stopped accepting and waited for open responses: end the scheduler
        await run_in_threadpool(ctx.scheduler.stop, shutdown_grace_s)

    app = FastAPI(title="moelora serve", lifespan=lifespan)
    app.state.ctx = ctx
    _errors(app)
    authorized = [Depends(_auth(ctx))]

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> str:
        # the slot manager's counters (the handle exposes no public copy of them yet)
        stats = ctx.handle._manager.stats()
        return ctx.metrics.render(sum(stats.loads.values()), stats.evictions)

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict:
        data = [{"id": name, "object": "model", "owned_by": "moelora",
                 "parent": None if name == ctx.served_model_name else ctx.served_model_name}
                for name in ctx.models]  # fmt: skip
        return {"object": "list", "data": data}

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(body: protocol.CompletionRequest, http: Request):
        return await _generate(ctx, body, False, http)

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat(body: protocol.ChatCompletionRequest, http: Request):
        return await _generate(ctx, body, True, http)

    @app.post("/v1/load_lora_adapter", dependencies=authorized)
    async def load(body: protocol.LoadLoraRequest) -> PlainTextResponse:
        _runtime_lora_on(ctx)
        try:  # a refused load changes nothing: the old version (if any) keeps serving
            await run_in_threadpool(ctx.handle.load_adapter, body.lora_path, body.lora_name)
        except (MoeloraError, OSError) as err:
            raise ServeError(400, f"adapter {body.lora_name!r} not loaded: {err}",
                             "BadRequestError", "lora_path") from err  # fmt: skip
        ctx.metrics.adapter(loaded=True)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=authorized)
    async def unload(body: protocol.UnloadLoraRequest) -> PlainTextResponse:
        _runtime_lora_on(ctx)
        if body.lora_name not in ctx.handle.adapters:
            raise ServeError(404, f"adapter {body.lora_name!r} is not loaded: expected one of "
                             f"{ctx.handle.adapters}", "NotFoundError", "lora_name")  # fmt: skip
        await run_in_threadpool(ctx.handle.unload_adapter, body.lora_name)
        ctx.metrics.adapter(loaded=False)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return app


async def _generate(ctx: ServeContext, body: protocol.SamplingFields, chat: bool, http: Request):
    if not body.stream:
        return await _unless_gone(answer(ctx, body, chat), http)
    request, stop = ctx.request(body)
    generation = Generation(ctx, request, stop)
    await generation.start()  # refusals (Engine.check) answer 400 before any byte is sent
    events = _events(generation, body.model, chat)
    return StreamingResponse(events, media_type="text/event-stream")


async def _unless_gone(work, http: Request, poll_s: float = 0.5):
    """Await `work`; a client that disconnects first cancels it (its generation closes and
    the row is freed at the next step). `poll_s`: how often the connection is looked at."""
    task = asyncio.ensure_future(work)
    while not (await asyncio.wait({task}, timeout=poll_s))[0]:
        if await http.is_disconnected():
            task.cancel()
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    return task.result()


async def _events(generation: Generation, model: str, chat: bool):
    """Server-sent events: one chunk per delta, the last with its finish reason, then [DONE].
    A client that leaves cancels this generator: its row is freed at the next step."""
    rid, first = generation.request.request_id, True
    try:
        async for delta, reason in generation.deltas():
            body = protocol.chunk(rid, model, delta, reason, chat, first)
            first = False
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        generation.close()


def _runtime_lora_on(ctx: ServeContext) -> None:
    if not ctx.runtime_lora:
        raise ServeError(403, "runtime adapter loading is off: expected the server started "
                         "with --enable-runtime-lora", "PermissionDeniedError")  # fmt: skip


def _auth(ctx: ServeContext):
    async def check(request: Request) -> None:
        if ctx.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {ctx.api_key}":
            raise ServeError(401, "invalid or missing API key: expected the header "
                             "'Authorization: Bearer <--api-key>'", "AuthenticationError")  # fmt: skip

    return check


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ServeError)
    async def serve_error(request: Request, err: ServeError) -> JSONResponse:
        body = protocol.error_body(str(err), err.kind, err.status, err.param)
        return JSONResponse(body, status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())[1:]) or "body"
        got = first.get("input")
        message = (
            f"invalid JSON body: {first.get('msg')}"
            if first.get("type") == "json_invalid"
            else f"field '{field}' = {got!r}: {first.get('msg')}"
        )
        return JSONResponse(protocol.error_body(message, "BadRequestError", 400, field), 400)
