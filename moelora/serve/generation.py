"""Requests through the scheduler, read from asyncio: the HTTP handlers and run-batch both
use them, so a streamed response, a whole one and a batch line carry the same text, and the
same logprobs (logprobs.py: a streamed chunk carries those of the tokens its text comes
from; text held back holds its tokens' logprobs back with it).

Every request that starts (passes the engine's check) is counted once in the metrics when
it ends, under the reason its client read: stop, length, cancelled (the client left) or
error (it failed after starting; the client reads an OpenAI error). A request refused
before it starts is counted as refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..errors import MoeloraError
from . import logprobs, protocol
from .context import Choice, Prepared, ServeContext, ServeError
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


@dataclass(frozen=True)
class Piece:
    """What a choice shows next: text, the finish reason (None until the last piece), and
    the logprobs object of the tokens it comes from (None: not asked)."""

    text: str
    reason: str | None
    logprobs: dict | None = None


class Generation:
    """One choice: `await start()` (raises ServeError when refused; returns once the request
    runs), then `async for piece in pieces()`. `close()` cancels an unfinished one."""

    def __init__(self, ctx: ServeContext, choice: Choice, stop: tuple[str, ...],
                 chat: bool = False) -> None:  # fmt: skip
        self.ctx, self.choice, self.request, self.chat = ctx, choice, choice.request, chat
        self.text = TextStream(ctx.tokenizer, stop)
        self.texts = logprobs.Texts(ctx.tokenizer)
        self.completion_tokens = 0
        self.done = False  # no more items are read (ended, failed, or closed)
        self.started = False  # passed the engine's check: counted once when it ends
        self.prompt_logprobs: list | None = None  # the engine's, when the request asked
        # tokens shown (echoed prompt, then generated) and their logprobs; [sent:] not yet
        self._tokens: list[int] = []
        self._positions: list = []
        self._sent = 0
        self._offset = 0  # text_offset of the next streamed token: the text sent so far
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

    async def pieces(self) -> AsyncIterator[Piece]:
        """The choice's pieces; with echo, the first starts with the prompt."""
        prefix = ""
        while not self.done:
            item = await self._queue.get()
            if isinstance(item, Refused):  # cancelled at shutdown, or an engine fault
                self._end("error")
                raise failure(item.error)
            if item.error is not None:  # the row failed inside a step
                self._end("error")
                raise failure(item.error)
            if item.prompt_logprobs is not None:
                self.prompt_logprobs = item.prompt_logprobs
            if self.choice.echo is not None and not self._tokens:
                prefix = self._echo()
            delta = ""
            if item.token_id >= 0:
                self.completion_tokens += 1
                delta = self.text.push(item.token_id)
                if not self.choice.echo_only:
                    self._tokens.append(item.token_id)
                    self._positions.append(item.logprobs)
            if self.choice.echo_only:  # the prompt alone (vLLM's max_tokens 0)
                delta = ""
            if self.text.stopped:  # a stop string: the engine need not go on
                if not item.finished:
                    self.ctx.scheduler.cancel(self.request.request_id)
                yield self._piece(prefix + delta, self._end("stop"))
            elif item.finished:
                tail = "" if self.choice.echo_only else self.text.finish()
                yield self._piece(prefix + delta + tail, self._end(item.finish_reason))
            elif prefix or delta:
                yield self._piece(prefix + delta, None)
            prefix = ""

    def _echo(self) -> str:
        """The prompt's tokens and logprobs shown before the completion; its text."""
        prompt = list(self.request.prompt_ids)
        self._tokens += prompt
        self._positions += self.prompt_logprobs or [None] * len(prompt)
        return self.choice.echo

    def _piece(self, text: str, reason: str | None) -> Piece:
        """A piece with the logprobs of the tokens not sent yet (all of them so far)."""
        lp = self.logprobs(self._sent, self._offset)
        self._sent, self._offset = len(self._tokens), self._offset + len(text)
        return Piece(text, reason, lp)

    def logprobs(self, start: int = 0, offset: int = 0) -> dict | None:
        """The logprobs object of the tokens from `start` (None when not asked)."""
        top = self.choice.top
        if top is None:
            return None
        positions = self._positions[start:]
        if self.chat:
            return {"content": logprobs.chat_logprobs(positions, top, self.texts)}
        return logprobs.completion_logprobs(self._tokens[start:], positions, top, self.texts,
                                            offset)  # fmt: skip

    def _end(self, reason: str | None) -> str | None:
        """Done with `reason`, the one the client reads, counted here once (the engine may
        have ended the row otherwise: by length, just before a stop string)."""
        self.done = True
        if self.started and not self._counted:
            self._counted = True
            self.ctx.metrics.finished(reason or "stop")
        return reason

    async def whole(self) -> dict:
        """The whole choice (protocol.choice's fields but the index)."""
        parts, last = [], None
        async for piece in self.pieces():
            parts.append(piece.text)
            last = piece.reason
        out = {"text": "".join(parts), "reason": last, "logprobs": self.logprobs()}
        if self.prompt_logprobs is not None:  # vLLM's field, when computed
            out["prompt_logprobs"] = logprobs.prompt_logprobs(self.prompt_logprobs, self.texts)
        return out

    def close(self) -> None:
        """The reader is done; if the request is not (its client left, or another prompt of
        its body failed), it is cancelled and, once started, counted as cancelled."""
        if not self.done:
            self._end("cancelled")
            self.ctx.scheduler.cancel(self.request.request_id)

    def _sink(self, item: object) -> None:  # the scheduler thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)


class Generations:
    """Every choice of one body: started together (a refusal of one cancels the others),
    read whole or as one stream of (choice index, piece)."""

    def __init__(self, ctx: ServeContext, prepared: Prepared) -> None:
        self.ctx, self.prepared = ctx, prepared
        self.items = [Generation(ctx, c, prepared.stop, prepared.chat)
                      for c in prepared.choices]  # fmt: skip
        self._closed = False

    async def start(self) -> None:
        await self._all([g.start() for g in self.items])

    def usage(self) -> dict[str, int]:
        """Each prompt counted once, whatever its `n` (vLLM's usage)."""
        return protocol.usage(
            sum(g.prompt_tokens for g in self.items if g.choice.first),
            sum(g.completion_tokens for g in self.items),
        )

    async def whole(self) -> list[dict]:
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

    async def stream(self) -> AsyncIterator[tuple[int, Piece]]:
        """(index, piece) as each choice's pieces come; raises the first failure."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, generation: Generation) -> None:
            try:
                async for piece in generation.pieces():
                    await queue.put((index, piece))
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
        """Cancel what still runs; the first time, each prompt whose choices started is
        counted in the metrics (its n, the most tokens one of its choices generated)."""
        for g in self.items:
            g.close()
        if self._closed:
            return
        self._closed = True
        groups: list[list[Generation]] = []
        for g in self.items:  # a prompt's n choices follow its first
            if g.choice.first:
                groups.append([])
            groups[-1].append(g)
        for group in groups:
            if any(g.started for g in group):
                self.ctx.metrics.prompt_ended(len(group), max(g.completion_tokens for g in group))


async def answer(ctx: ServeContext, body: protocol.SamplingFields, chat: bool) -> dict:
    """The whole (non-streamed) response to a completions or chat body."""
    prepared = await asyncio.to_thread(ctx.prepare, body)
    generations = Generations(ctx, prepared)
    await generations.start()
    choices = await generations.whole()
    return protocol.completion(prepared.response_id, body.model, choices, generations.usage(), chat)
