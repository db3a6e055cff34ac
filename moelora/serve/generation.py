"""Requests through the scheduler, read from asyncio: the HTTP handlers and run-batch both
use them, so a streamed response, a whole one and a batch line carry the same text.

Every request that starts (passes the engine's check) is counted once in the metrics when
it ends, under the reason its client read: stop, length, cancelled (the client left) or
error (it failed after starting; the client reads an OpenAI error). A request refused
before it starts is counted as refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ..errors import MoeloraError
from . import protocol
from .context import Prepared, ServeContext, ServeError
from .scheduler import Accepted, Admitted, EngineDead, Refused, ShuttingDown
from .text import TextStream


def failure(error: Exception) -> ServeError:
    """The ServeError a client reads for a request the engine refused or failed."""
    if isinstance(error, ServeError):
        return error
    if isinstance(error, (ShuttingDown, EngineDead)):
        return ServeError(503, str(error), "ServiceUnavailableError")
    if isinstance(error, MoeloraError):  # a refusal of the request's own values
        return ServeError(400, str(error), "BadRequestError")
    return ServeError(500, f"generation failed: {error}", "InternalServerError")


class Generation:
    """One prompt: `await start()` (raises ServeError when refused; returns once the request
    runs), then `async for delta, reason`: the finish reason is None until the last delta.
    `close()` cancels an unfinished one."""

    def __init__(self, ctx: ServeContext, request, stop: tuple[str, ...]) -> None:
        self.ctx, self.request = ctx, request
        self.text = TextStream(ctx.tokenizer, stop)
        self.completion_tokens = 0
        self.done = False  # no more items are read (ended, failed, or closed)
        self.started = False  # passed the engine's check: counted once when it ends
        self._counted = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    async def start(self) -> None:
        self.ctx.scheduler.submit(self.request, self._sink)
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, Refused):
                    if self.started:
                        self._end("error")
                    elif not self.done:
                        self.done = True
                        self.ctx.metrics.refused()
                    raise failure(item.error)
                if isinstance(item, Accepted):
                    self.started = True
                    self.ctx.metrics.started(self.prompt_tokens)
                    continue
                assert isinstance(item, Admitted), item
                return
        except asyncio.CancelledError:  # the client left while the request waited
            self.close()
            raise

    async def deltas(self) -> AsyncIterator[tuple[str, str | None]]:
        while not self.done:
            item = await self._queue.get()
            if isinstance(item, Refused):  # cancelled at shutdown, or an engine fault
                self._end("error")
                raise failure(item.error)
            if item.error is not None:  # the row failed inside a step
                self._end("error")
                raise failure(item.error)
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
        """Done with `reason`, the one the client reads, counted here once (the engine may
        have ended the row otherwise: by length, just before a stop string)."""
        self.done = True
        if self.started and not self._counted:
            self._counted = True
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
        """The reader is done; if the request is not (its client left, or another prompt of
        its body failed), it is cancelled and, once started, counted as cancelled."""
        if not self.done:
            self._end("cancelled")
            self.ctx.scheduler.cancel(self.request.request_id)

    def _sink(self, item: object) -> None:  # the scheduler thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)


class Generations:
    """Every prompt of one body: started together (a refusal of one cancels the others),
    read whole or as one stream of (choice index, delta, reason)."""

    def __init__(self, ctx: ServeContext, prepared: Prepared) -> None:
        self.prepared = prepared
        self.items = [Generation(ctx, r, prepared.stop) for r in prepared.requests]

    async def start(self) -> None:
        await self._all([g.start() for g in self.items])

    def usage(self) -> dict[str, int]:
        return protocol.usage(
            sum(g.prompt_tokens for g in self.items),
            sum(g.completion_tokens for g in self.items),
        )

    async def whole(self) -> list[tuple[str, str | None]]:
        try:
            return await self._all([g.whole() for g in self.items])
        finally:
            self.close()

    async def _all(self, work: list) -> list:
        """Every result of `work`; the first failure cancels the rest and is raised."""
        tasks = [asyncio.ensure_future(w) for w in work]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            self.close()
            raise

    async def stream(self) -> AsyncIterator[tuple[int, str, str | None]]:
        """(index, delta, reason) as each prompt's deltas come; raises the first failure."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, generation: Generation) -> None:
            try:
                async for delta, reason in generation.deltas():
                    await queue.put((index, delta, reason))
            except Exception as err:
                await queue.put(err)
            finally:
                await queue.put(None)

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(self.items)]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            self.close()

    def close(self) -> None:
        for g in self.items:
            g.close()


async def answer(ctx: ServeContext, body: protocol.SamplingFields, chat: bool) -> dict:
    """The whole (non-streamed) response to a completions or chat body."""
    prepared = await asyncio.to_thread(ctx.prepare, body)
    generations = Generations(ctx, prepared)
    await generations.start()
    choices = await generations.whole()
    return protocol.completion(prepared.response_id, body.model, choices, generations.usage(), chat)
