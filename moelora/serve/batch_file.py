"""OpenAI's batch file format (vLLM's run_batch): one request per input line,
{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions", "body"},
one result per output line in input order,
{"id", "custom_id", "response": {"status_code", "request_id", "body"} | null, "error"}.

Every line goes through the same scheduler as the server, all at once (the scheduler holds
what does not fit); a line that fails gets an error record with its custom_id and
{"code", "message"}; the others still run.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable

from pydantic import ValidationError

from . import protocol
from .context import ServeContext, ServeError
from .generation import answer

ROUTES = {
    "/v1/completions": (protocol.CompletionRequest, False),
    "/v1/chat/completions": (protocol.ChatCompletionRequest, True),
}


async def run_lines(ctx: ServeContext, lines: list[str], done: Callable[[], None]) -> list[dict]:
    """The output records of the input lines (blank lines skipped), in order; `done()` is
    called as each finishes (the progress bar)."""

    async def one(number: int, line: str) -> dict:
        try:
            return await _answer_line(ctx, number, line)
        finally:
            done()

    return await asyncio.gather(*(one(n, line) for n, line in lines_of(lines)))


def lines_of(lines: list[str]) -> list[tuple[int, str]]:
    return [(n, line) for n, line in enumerate(lines, 1) if line.strip()]


async def _answer_line(ctx: ServeContext, number: int, line: str) -> dict:
    custom_id = None
    try:
        record = json.loads(line)
        if not isinstance(record, dict):
            raise ServeError(400, f"line {number}: expected a JSON object", "BadRequestError")
        custom_id = record.get("custom_id")
        url = record.get("url")
        if url not in ROUTES:
            raise ServeError(400, f"line {number}: url = {url!r}: expected one of "
                             f"{sorted(ROUTES)}", "BadRequestError", "url")  # fmt: skip
        model, chat = ROUTES[url]
        body = model.model_validate(record.get("body"))
        response = await answer(ctx, body, chat)
    except json.JSONDecodeError as err:
        return _error(custom_id, 400, f"line {number}: invalid JSON: {err}")
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        return _error(custom_id, 400, f"line {number}: body field '{field}' = "
                      f"{first.get('input')!r}: {first['msg']}")  # fmt: skip
    except ServeError as err:
        return _error(custom_id, err.status, str(err))
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": response["id"], "body": response},
        "error": None,
    }


def _error(custom_id, code: int, message: str) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
