"""One request through the scheduler, read from asyncio: the HTTP handlers and run-batch
both use it, so a streamed response, a whole one and a batch line carry the same text."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ..errors import MoeloraError
from . import protocol
from .context import ServeContext, ServeError
from .scheduler import Accepted, Refused
from .text import TextStream


class Generation:
    """`await start()` (raises ServeError when refused), then `async for delta, reason`:
    the finish reason is None until the last delta. `close()` cancels an unfinished one."""

    def __init__(self, ctx: ServeContext, request, stop: tuple[str, ...]) -> None:
        self.ctx, self.request = ctx, request
        self.text = TextStream(ctx.tokenizer, stop)
        self.completion_tokens = 0
        self.done = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    async def start(self) -> None:
        self.ctx.scheduler.submit(self.request, self._sink)
        try:
            first = await self._queue.get()
        except asyncio.CancelledError:  # the client left before the check answered
            self.close()
            raise
        if isinstance(first, Refused):
            self.done = True
            raise ServeError(400, str(first.error), "BadRequestError", "prompt")
        assert isinstance(first, Accepted), first
        self.ctx.metrics.prompt(self.prompt_tokens)

    async def deltas(self) -> AsyncIterator[tuple[str, str | None]]:
        while not self.done:
            item = await self._queue.get()
            if isinstance(item, Refused):  # while queued: its adapter unloaded; or a fault
                self.done = True
                if isinstance(item.error, MoeloraError):
                    raise ServeError(400, str(item.error), "BadRequestError", "model")
                raise ServeError(500, f"generation failed: {item.error}", "InternalServerError")
            delta = ""
            if item.token_id >= 0:
                self.completion_tokens += 1
                delta = self.text.push(item.token_id)
            if self.text.stopped:  # a stop string: the engine need not go on
                if not item.finished:
                    self.ctx.scheduler.cancel(self.request.request_id)
                yield delta, self._end("stop")
            elif item.finished:
                yield delta + self.text.finish(), self._end(item.finish_reason)
            elif delta:
                yield delta, None

    def _end(self, reason: str | None) -> str | None:
        """Done with `reason`, the one the client reads, counted in the metrics here (the
        engine may have ended the row otherwise: by length, just before a stop string). Every
        finished request is counted once, by its reader: here, or as cancelled by close()."""
        self.done = True
        self.ctx.metrics.finished(reason or "stop")
        return reason

    async def whole(self) -> tuple[str, str | None]:
        """The whole text and finish reason."""
        parts, last = [], None
        async for delta, reason in self.deltas():
            parts.append(delta)
            last = reason
        return "".join(parts), last

    def close(self) -> None:
        """The reader is done; if the request is not (its client left), it is cancelled and
        counted as such, whether or not the engine had finished it."""
        if not self.done:
            self.done = True
            self.ctx.metrics.finished("cancelled")
            self.ctx.scheduler.cancel(self.request.request_id)

    def _sink(self, item: object) -> None:  # the scheduler thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)


async def answer(ctx: ServeContext, body: protocol.SamplingFields, chat: bool) -> dict:
    """The whole (non-streamed) response to a completions or chat body."""
    request, stop = ctx.request(body)
    generation = Generation(ctx, request, stop)
    try:
        await generation.start()
        text, reason = await generation.whole()
    finally:
        generation.close()
    use = protocol.usage(generation.prompt_tokens, generation.completion_tokens)
    return protocol.completion(request.request_id, body.model, text, reason, use, chat)
