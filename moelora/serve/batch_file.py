"""OpenAI's batch file format (vLLM's run_batch): one request per input line,
{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions", "body"},
one record per output line, in completion order (OpenAI's batch output is matched by
custom_id, not by position),
{"id", "custom_id", "response": {"status_code", "request_id", "body"} | null, "error"}.

The input is read as bytes and each line decoded on its own, so one bad line is that line's
refusal: an error record {"code", "message"} naming its line number, the field and what was
expected; the other lines still run. Every custom_id appears at most once in the output: a line
whose custom_id is missing, not a non-empty string, or already used by an earlier line is
refused with custom_id null (the earlier line runs).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from pydantic import ValidationError

from . import protocol
from .context import ServeContext, ServeError
from .generation import answer

ROUTES = {
    "/v1/completions": (protocol.CompletionRequest, False),
    "/v1/chat/completions": (protocol.ChatCompletionRequest, True),
}


@dataclass(frozen=True)
class BatchLine:
    """One input line that passed every check: it runs."""

    number: int  # 1-based, blank lines counted
    custom_id: str
    body: protocol.SamplingFields
    chat: bool


class LineRefused(Exception):
    """An input line that cannot run; the message names the line, the field, the expected."""

    def __init__(self, number: int, message: str, custom_id: str | None = None) -> None:
        super().__init__(f"line {number}: {message}")
        self.custom_id = custom_id


def count_lines(data: bytes) -> int:
    """The input lines that get a record: every non-blank one."""
    return sum(1 for raw in data.splitlines() if raw.strip())


def parse_lines(data: bytes) -> Iterator[BatchLine | dict]:
    """Each non-blank line of the input file, in order: a BatchLine to run, or the error
    record refusing it. Splitting bytes is safe: no UTF-8 sequence holds a newline byte."""
    seen: dict[str, int] = {}  # custom_id -> the line that claimed it
    for number, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            item = _parse(number, raw, seen)
        except LineRefused as err:
            item = error_record(err.custom_id, 400, str(err))
        yield item


def _parse(number: int, raw: bytes, seen: dict[str, int]) -> BatchLine:
    try:
        text = raw.decode("utf-8-sig")  # a BOM (some editors write one) is not JSON
    except UnicodeDecodeError as err:
        raise LineRefused(number, f"not valid UTF-8 ({err.reason} at byte {err.start}): "
                          "expected UTF-8 text") from None  # fmt: skip
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise LineRefused(
            number, f"invalid JSON ({err}): expected one JSON object per line"
        ) from None
    if not isinstance(record, dict):
        raise LineRefused(number, f"a JSON {type(record).__name__}: expected an object "
                          "{custom_id, method, url, body}")  # fmt: skip
    custom_id = _claim(number, record, seen)
    method = record.get("method")
    if method != "POST":
        raise LineRefused(number, f"method = {method!r}: expected 'POST'", custom_id)
    url = record.get("url")
    if url not in ROUTES:
        raise LineRefused(number, f"url = {url!r}: expected one of {sorted(ROUTES)}", custom_id)
    model, chat = ROUTES[url]
    try:
        body = model.model_validate(record.get("body"))
    except ValidationError as err:  # worded as the server words it (protocol.refusal)
        message, _ = protocol.refusal(err)
        raise LineRefused(number, f"body: {message}", custom_id) from None
    return BatchLine(number, custom_id, body, chat)


def _claim(number: int, record: dict, seen: dict[str, int]) -> str:
    """The line's custom_id, now taken; refused (custom_id null) when missing, not a
    non-empty string, or already taken by an earlier line."""
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        got = "missing" if "custom_id" not in record else f"= {custom_id!r}"
        raise LineRefused(number, f"custom_id {got}: expected a non-empty string, unique in "
                          "the file")  # fmt: skip
    if custom_id in seen:
        raise LineRefused(number, f"custom_id = {custom_id!r} is already used by line "
                          f"{seen[custom_id]}: expected each custom_id once (line "
                          f"{seen[custom_id]} runs, this line does not)")  # fmt: skip
    seen[custom_id] = number
    return custom_id


async def answer_line(ctx: ServeContext, line: BatchLine) -> dict:
    """The output record of one line; any fault answering it is that line's error record,
    never the end of the job."""
    try:
        response = await answer(ctx, line.body, line.chat)
    except ServeError as err:
        return error_record(line.custom_id, err.status, f"line {line.number}: {err}")
    except Exception as err:
        return error_record(line.custom_id, 500, f"line {line.number}: {type(err).__name__}: "
                            f"{err}")  # fmt: skip
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": line.custom_id,
        "response": {"status_code": 200, "request_id": response["id"], "body": response},
        "error": None,
    }


async def run_lines(
    ctx: ServeContext, items: Iterable[BatchLine | dict], write: Callable[[dict], None],
    window: int,
) -> None:  # fmt: skip
    """Runs every BatchLine, at most `window` at once, and hands each record to `write` as
    soon as its line finishes (a refusal's at once). Cancelled: the lines still running are
    cancelled and get no record; every finished one has been written."""
    running: set[asyncio.Task] = set()
    try:
        for item in items:
            if isinstance(item, dict):
                write(item)
                continue
            if len(running) >= window:
                running = await _write_finished(running, write)
            running.add(asyncio.create_task(answer_line(ctx, item)))
        while running:
            running = await _write_finished(running, write)
    except asyncio.CancelledError:
        finished = {task for task in running if task.done() and not task.cancelled()}
        running -= finished
        for task in finished:  # done before the stop, not written yet: kept
            write(task.result())
        raise
    finally:
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)


async def _write_finished(running: set[asyncio.Task], write: Callable[[dict], None]) -> set:
    """Waits for at least one line to finish, writes every finished one; the rest."""
    done, pending = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
    for task in done:
        write(task.result())
    return pending


def error_record(custom_id: str | None, code: int, message: str) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
