"""The OpenAI request and response bodies the server reads and writes (vLLM's subset).

Request models refuse unknown types and out-of-range values (pydantic); the app turns each
refusal into a 400 OpenAI error body naming the field. Responses are plain dicts built here.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# OpenAI fields this server does not implement, with the value that means "off": any other
# value is refused (400 naming it) rather than silently ignored.
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False),
               "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "tools": (None, []), "response_format": (None,)}  # fmt: skip


class _Body(BaseModel):
    # OpenAI clients send fields the server does not use (user, logit_bias, ...): accepted.
    model_config = ConfigDict(extra="allow")


class SamplingFields(_Body):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM's extension; -1 and 0 mean off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)  # one choice per request
    ignore_eos: bool = False  # vLLM's extension: run to max_tokens past end tokens
    min_tokens: int = Field(default=0, ge=0)  # vLLM's extension: no end token before

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SamplingFields:
        for name, off in UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name)
            if value not in off:
                raise ValueError(f"{name} = {value!r} is not supported by moelora serve: "
                                 f"leave it out (expected one of {list(off)})")  # fmt: skip
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)


class CompletionRequest(SamplingFields):
    """POST /v1/completions: prompt is text or token ids (one prompt per request)."""

    prompt: str | list[int]


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: messages rendered by the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)


class LoadLoraRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1)


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    """OpenAI's error object: {"error": {message, type, param, code}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion(
    rid: str, model: str, text: str, reason: str | None, usage: dict, chat: bool
) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion response."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
    kind = "chat.completion" if chat else "text_completion"
    return _response(rid, kind, model, choice, reason) | {"usage": usage}


def chunk(
    rid: str, model: str, text: str, reason: str | None, chat: bool, first: bool = False
) -> dict[str, Any]:
    """One server-sent event's body of a streamed response."""
    if chat:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
    kind = "chat.completion.chunk" if chat else "text_completion"
    return _response(rid, kind, model, choice, reason)


def _response(rid: str, kind: str, model: str, choice: dict, reason: str | None) -> dict:
    """The fields every response and chunk share, in OpenAI's order; one choice."""
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice | {"finish_reason": reason}],
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
