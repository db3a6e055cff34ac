"""The finish reason the metrics count is the one the client reads: a stop string found in the
last tokens of a row the engine already ended by length counts as "stop" (the engine's
"length" never reaches the client), and a client's leaving counts as "cancelled" even when
the engine had already finished its row: every request is counted once, by its reader."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

from test_serve_scheduler import ScriptedEngine, request, token

from moelora.serve.context import Choice
from moelora.serve.generation import Generation
from moelora.serve.metrics import Metrics
from moelora.serve.scheduler import Scheduler


class WordTokenizer:
    """Token id i decodes to the word "w<i>" followed by a space."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(f"w{i} " for i in ids)


def run(stop_at: int | None, new: int, leave_after: int | None = None) -> tuple[str, Metrics]:
    """One request of `new` tokens through a real Scheduler over the scripted engine; the
    stop string is the word of token `stop_at` (None: no stop string). Returns the text read
    and the metrics."""
    engine, metrics = ScriptedEngine(rows=2, slots=1), Metrics()
    scheduler = Scheduler(engine, metrics, idle_wait_s=0.01).start()
    rid = f"r{random.randrange(10**9)}"
    if stop_at is not None:  # a stop word inside an earlier word ("w10" in "w104") cuts early
        while f"w{token(rid, stop_at)}" in WordTokenizer().decode(
            token(rid, i) for i in range(stop_at)
        ):
            rid = f"r{random.randrange(10**9)}"
    stop = () if stop_at is None else (f"w{token(rid, stop_at)}",)

    async def read() -> str:
        ctx = SimpleNamespace(scheduler=scheduler, tokenizer=WordTokenizer(), metrics=metrics)
        gen = Generation(ctx, Choice(request(rid, None, new), first=True), stop)
        await gen.start()
        parts, reads = [], 0
        async for piece in gen.pieces():
            parts.append(piece.text)
            reads += 1
            if leave_after is not None and reads == leave_after:
                gen.close()
                break
        return "".join(parts)

    try:
        text = asyncio.run(asyncio.wait_for(read(), 30))
        for _ in range(600):  # bounded: the scheduler counts a leaving at its next step
            if sum(metrics.requests.values()) >= 1:
                break
            asyncio.run(asyncio.sleep(0.01))
    finally:
        scheduler.stop()
    return text, metrics


def test_stop_string_in_the_last_token_counts_as_stop() -> None:
    text, metrics = run(stop_at=4, new=4)  # the engine ends the row by length at token 4
    assert metrics.requests == {"stop": 1}, metrics.requests
    assert text.count("w") == 3  # tokens 1..3, the stop word and what follows cut


def test_a_finished_row_counts_its_engine_reason() -> None:
    text, metrics = run(stop_at=None, new=3)
    assert metrics.requests == {"length": 1} and text.count("w") == 3


def test_a_client_leaving_counts_as_cancelled() -> None:
    _, metrics = run(stop_at=None, new=50, leave_after=1)
    assert metrics.requests == {"cancelled": 1}, metrics.requests
