"""The ASGI app (FastAPI): OpenAI's completions, chat completions and models routes, vLLM's
runtime adapter routes, /health and Prometheus /metrics, over one ServeContext.

Every answer that is not a success is an OpenAI error body ({"error": {message, type, param,
code}}), whatever raised it: 400 a malformed body or field, 401 a wrong or missing API key,
403 runtime loading while it is off, 404 an unknown model, adapter or route, 405 a wrong
method, 408 / 413 a body too slow or too large (limits.py), 500 a fault of the server (its
message says which), 503 while shutting down or once the engine has stopped. A stream that
fails after its first byte ends with an error event, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ..errors import MoeloraError
from . import protocol, tokenization
from .context import ServeContext, ServeError, bad_request
from .generation import Generations, answer, failure
from .limits import BodyLimit, body_limit

log = logging.getLogger("moelora.serve")


def build_app(
    ctx: ServeContext,
    shutdown_grace_s: float = 30.0,
    body_read_timeout_s: float = 30.0,
    resolver=None,  # resolver.LoraResolver: --lora-resolver-dir, unknown adapters by name
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # uvicorn has stopped accepting and waited for open responses: end the scheduler
        await run_in_threadpool(ctx.scheduler.stop, shutdown_grace_s)

    # the generated API pages are public routes: closed when the API needs a key
    docs = {} if ctx.api_key is None else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="moelora serve", lifespan=lifespan, **docs)
    app.state.ctx = ctx
    app.state.resolver = resolver
    app.add_middleware(BodyLimit, max_bytes=body_limit(ctx.max_model_len),
                       read_timeout_s=body_read_timeout_s)  # fmt: skip
    _errors(app)
    authorized = [Depends(_auth(ctx))]
    # runtime loading's switch is looked at before the body (a dependency runs first)
    runtime = [*authorized, Depends(_runtime_lora(ctx))]

    @app.get("/health")
    async def health() -> Response:
        scheduler = ctx.scheduler
        if not scheduler.alive:
            fault = scheduler.fault
            body = {"status": "dead", "error": None if fault is None else repr(fault)}
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> str:
        return ctx.metrics.render(ctx.handle)  # slot residency and counters read now

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict:
        data = [{"id": name, "object": "model", "owned_by": "moelora",
                 "parent": None if name == ctx.served_model_name else ctx.parents.get(
                     name, ctx.served_model_name)}
                for name in ctx.models]  # fmt: skip
        return {"object": "list", "data": data}

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(body: protocol.CompletionRequest, http: Request):
        return await _generate(ctx, body, False, http)

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat(body: protocol.ChatCompletionRequest, http: Request):
        return await _generate(ctx, body, True, http)

    # vLLM's tokenizer routes (tokenization.py); lm-evaluation-harness reads them
    @app.post("/tokenize", dependencies=authorized)
    async def tokenize(body: protocol.TokenizeRequest) -> dict:
        return await run_in_threadpool(tokenization.tokenize, ctx, body)

    @app.post("/detokenize", dependencies=authorized)
    async def detokenize(body: protocol.DetokenizeRequest) -> dict:
        return await run_in_threadpool(tokenization.detokenize, ctx, body)

    @app.get("/tokenizer_info", dependencies=authorized)
    async def tokenizer_info() -> dict:
        return tokenization.tokenizer_info(ctx)

    @app.post("/v1/load_lora_adapter", dependencies=runtime)
    async def load(body: protocol.LoadLoraRequest) -> PlainTextResponse:
        name = body.lora_name
        if name == ctx.served_model_name:
            raise bad_request(f"lora_name {name!r} is the base model's name: expected another "
                              "name (requests name the base model by it)", "lora_name")  # fmt: skip
        path = _adapter_dir(ctx, body.lora_path)
        started = time.perf_counter()
        try:  # a refused load changes nothing: the old version (if any) keeps serving
            await run_in_threadpool(ctx.handle.load_adapter, path, name)
        except MoeloraError as err:
            raise bad_request(f"adapter {name!r} not loaded: {err}", "lora_path") from err
        except (OSError, ValueError) as err:  # unreadable: the same words whatever the cause
            log.info("runtime load of %r from %r failed: %r", name, body.lora_path, err)
            raise _not_an_adapter(ctx, body.lora_path) from None
        ctx.metrics.adapter(loaded=True)
        ctx.metrics.adapter_loaded("runtime", time.perf_counter() - started)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=runtime)
    async def unload(body: protocol.UnloadLoraRequest) -> PlainTextResponse:
        if body.lora_name not in ctx.handle.adapters:
            raise ServeError(404, f"adapter {body.lora_name[:200]!r} is not loaded: expected "
                             f"one of {ctx.handle.adapters}", "NotFoundError",
                             "lora_name")  # fmt: skip
        await run_in_threadpool(ctx.handle.unload_adapter, body.lora_name)
        ctx.metrics.adapter(loaded=False)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return app


async def _generate(ctx: ServeContext, body: protocol.SamplingFields, chat: bool, http: Request):
    if http.app.state.resolver is not None:  # an unknown adapter name: loaded from its dir
        await http.app.state.resolver.resolve(body.model)
    if not body.stream:
        return await _unless_gone(answer(ctx, body, chat), http)
    prepared = await asyncio.to_thread(ctx.prepare, body)  # tokenizing: off the event loop
    generations = Generations(ctx, prepared)
    # refusals (the engine's check, an adapter unloaded while queued) answer 4xx before any
    # byte of the stream is sent: the response starts once every prompt runs
    gone = await _unless_gone(generations.start(), http)
    if gone is not None:
        return gone
    events = _events(generations, body, chat)
    return StreamingResponse(events, media_type="text/event-stream")


async def _unless_gone(work, http: Request, poll_s: float = 0.5):
    """Await `work`; a client that disconnects first cancels it (its generations close and
    their rows are freed at the next step). `poll_s`: how often the connection is looked at."""
    task = asyncio.ensure_future(work)
    while not (await asyncio.wait({task}, timeout=poll_s))[0]:
        if await http.is_disconnected():
            task.cancel()
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    return task.result()


async def _events(generations: Generations, body: protocol.SamplingFields, chat: bool):
    """Server-sent events: one chunk per delta (the last of each choice with its finish
    reason), the usage chunk when asked, then [DONE]. A failure after the first byte is an
    error event before [DONE]. A client that leaves cancels this generator: its rows are
    freed at the next step."""
    rid, model = generations.prepared.response_id, body.model
    first = set(range(len(generations.items)))
    try:
        async for index, piece in generations.stream():
            usage = generations.usage() if body.continuous_usage else None
            out = protocol.chunk(rid, model, index, piece.text, piece.reason, chat,
                                 index in first, usage, piece.logprobs)  # fmt: skip
            first.discard(index)
            yield _sse(out)
        if body.include_usage:
            yield _sse(protocol.usage_chunk(rid, model, chat, generations.usage()))
    except Exception as err:  # the stream has started: the error travels as an event
        fault = failure(err)
        if fault.status >= 500:
            log.warning("stream %s failed: %s", rid, fault)
        yield _sse(protocol.error_body(str(fault), fault.kind, fault.status, fault.param))
    finally:
        generations.close()
    yield "data: [DONE]\n\n"


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _adapter_dir(ctx: ServeContext, given: str) -> Path:
    """The directory a runtime load reads: under --allowed-local-lora-path when it is set (a
    relative path is taken from there; links are followed before the check), and a PEFT
    adapter directory; refusals use the same words whether or not the path exists."""
    try:
        path = Path(given)
        root = ctx.allowed_lora_root
        if root is not None:
            path = (root / path).resolve()
            if not path.is_relative_to(root):
                raise ServeError(
                    403,
                    f"lora_path {given[:200]!r} is outside the directory runtime loads may read: "
                    "expected a path under the server's --allowed-local-lora-path",
                    "PermissionDeniedError",
                    "lora_path",
                )
        if (path / "adapter_config.json").is_file():
            return path
    except (OSError, ValueError):
        pass
    raise _not_an_adapter(ctx, given)


def _not_an_adapter(ctx: ServeContext, given: str) -> ServeError:
    return bad_request(
        f"lora_path {given[:200]!r} is not a readable PEFT adapter directory: expected a "
        "directory with adapter_config.json and the adapter's weights"
        + ("" if ctx.allowed_lora_root is None else " under --allowed-local-lora-path"),
        "lora_path",
    )


def _runtime_lora(ctx: ServeContext):
    async def check() -> None:
        if not ctx.runtime_lora:
            raise ServeError(403, "runtime adapter loading is off: expected the server "
                             "started with --enable-runtime-lora", "PermissionDeniedError")  # fmt: skip

    return check


def _auth(ctx: ServeContext):
    async def check(request: Request) -> None:
        if ctx.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {ctx.api_key}":
            raise ServeError(401, "invalid or missing API key: expected the header "
                             "'Authorization: Bearer <--api-key>'", "AuthenticationError")  # fmt: skip

    return check


# Starlette's own refusals (no route, wrong method, a body it cannot parse) in OpenAI's words
_HTTP_KINDS = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError"}


def _errors(app: FastAPI) -> None:
    def answer_with(status: int, message: str, kind: str, param: str | None) -> JSONResponse:
        return JSONResponse(protocol.error_body(message, kind, status, param), status_code=status)

    @app.exception_handler(ServeError)
    async def serve_error(request: Request, err: ServeError) -> JSONResponse:
        return answer_with(err.status, str(err), err.kind, err.param)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, err: RequestValidationError) -> JSONResponse:
        message, param = protocol.refusal(list(err.errors()))
        return answer_with(400, message, "BadRequestError", param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        if err.status_code == 400:  # FastAPI could not read the body (not UTF-8, ...)
            message = "the request body could not be read: expected a UTF-8 JSON object"
        elif err.status_code == 404:
            message = f"no route {request.url.path[:200]!r}: see docs/serve.md for the routes"
        elif err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path[:200]!r}"
        else:
            message = str(err.detail)
        kind = _HTTP_KINDS.get(err.status_code, "APIError")
        return answer_with(err.status_code, message, kind, None)

    @app.exception_handler(Exception)
    async def fault(request: Request, err: Exception) -> JSONResponse:
        log.exception("request to %s failed", request.url.path)
        return answer_with(500, f"internal error: {err!r}", "InternalServerError", None)
