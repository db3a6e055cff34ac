"""The OpenAI request and response bodies the server reads and writes (vLLM's subset).

Every field a request may carry is declared here: the fields the server serves, OpenAI's
informational ones (`user`, `metadata`), and the OpenAI fields it does not implement, which
are accepted only at the value that means "off" (UNSUPPORTED). Anything else is refused, as
are values of the wrong JSON type (strict: `true` is not a number, `"yes"` not a boolean),
out-of-range values, NaN / Infinity, and strings that are not valid Unicode (an escaped lone
surrogate). `refusal()` turns a validation error into one message naming the field, the
value (shortened) and what was expected; the app answers it as a 400 OpenAI error body.
Responses are plain dicts built here.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

INT64 = (-(2**63), 2**63 - 1)  # vLLM's seed range (torch.Generator takes a signed 64-bit)
MAX_STOP = 64  # stop strings per request (OpenAI allows 4; vLLM sets no limit)
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs: top logprobs per position
MAX_N = 128  # choices per prompt: each is an engine row (they queue for rows like requests)

# OpenAI fields this server does not implement, with the values that mean "off": any other
# value is refused (400 naming it) rather than silently ignored.
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "parallel_tool_calls": (None, True, False),
    "store": (None, False),
}  # fmt: skip
# served on /v1/completions, not on chat (vLLM's chat echo repeats the last message; its
# chat prompt_logprobs is a response field of its own): off values only there
CHAT_UNSUPPORTED: dict[str, tuple] = {"echo": (None, False), "prompt_logprobs": (None,)}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        bad = _unpaired_surrogate(data)
        if bad is not None:
            path, char = bad
            raise ValueError(
                f"field '{path}' holds an unpaired UTF-16 surrogate (U+{ord(char):04X}): "
                "expected valid Unicode text"
            )
        return data


class _Unsupported(_Body):
    """The UNSUPPORTED fields, declared so that their "off" values pass."""

    best_of: Any = None
    suffix: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    store: Any = None

    _refused: ClassVar[dict[str, tuple]] = UNSUPPORTED

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Unsupported:
        for name, off in self._refused.items():
            value = getattr(self, name)
            if not any(value == o and type(value) is type(o) for o in off):
                raise ValueError(
                    f"{name} = {_short(value)} is not supported by moelora serve: leave it "
                    f"out (accepted only at {' or '.join(_short(o) for o in off)})"
                )
        return self


class StreamOptions(_Body):
    include_usage: bool = False  # a last chunk with the usage and no choices (OpenAI)
    continuous_usage_stats: bool = False  # the usage so far in every chunk (vLLM)


class JsonSchema(_Body):
    """response_format.json_schema (OpenAI's): the schema the output follows."""

    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format: text (no constraint), a JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(f"response_format of type {self.type!r} with json_schema = "
                             f"{_short(self.json_schema)}: expected json_schema exactly when "
                             "type is 'json_schema'")  # fmt: skip
        return self


class SamplingFields(_Unsupported):
    """What completions and chat completions share (vLLM's SamplingParams names)."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # below 1e-5: greedy (vLLM)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM's extension; -1 and 0 mean off
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # vLLM's extension
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)  # vLLM's; 1 = off
    seed: int | None = Field(default=None, ge=INT64[0], le=INT64[1])
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)  # choices per prompt (seed + j for choice j)
    response_format: ResponseFormat | None = None  # structured output (structured.py)
    ignore_eos: bool = False  # vLLM's extension: run to max_tokens past end tokens
    min_tokens: int = Field(default=0, ge=0)  # vLLM's extension: no end token before
    user: str | None = None  # OpenAI's end-user id: informational

    @model_validator(mode="after")
    def _consistent(self) -> SamplingFields:
        stops = self.stop_strings()
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop has {len(stops)} strings: expected at most {MAX_STOP}")
        if self.stop is not None and (not stops or "" in stops):
            raise ValueError(f"stop = {_short(self.stop)}: expected non-empty strings")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is set while stream is false: expected it only "
                             "with stream = true")  # fmt: skip
        limit = self.completion_limit()
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens = {self.min_tokens} is more than the completion's "
                             f"limit {limit}: expected min_tokens <= max_tokens")  # fmt: skip
        return self

    def completion_limit(self) -> int | None:
        """The most tokens a completion may have, as the request set it (None: unset)."""
        return self.max_tokens

    def token_logprobs(self) -> int | None:
        """Top logprobs per generated token (None: no logprobs)."""
        return None

    def constrained(self) -> bool:
        """The output follows a response_format other than text."""
        return self.response_format is not None and self.response_format.type != "text"

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    """POST /v1/completions: a prompt (text or token ids) or a list of them, `n` choices per
    prompt (`index` = prompt * n + choice, as vLLM numbers them)."""

    prompt: Prompt
    max_tokens: int | None = Field(default=None, ge=0)  # 0: with echo only (the prompt alone)
    echo: bool = False  # the prompt before the completion (its logprobs with `logprobs`)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's

    @model_validator(mode="after")
    def _prompts(self) -> CompletionRequest:
        prompts = self.prompts()
        if not prompts:
            raise ValueError("prompt is an empty list: expected a prompt or a list of prompts")
        for i, p in enumerate(prompts):
            if not p:
                where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise ValueError(f"{where} is empty: expected at least one token")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens = 0 without echo: expected max_tokens >= 1, or echo = "
                             "true to score the prompt alone (vLLM's rule)")  # fmt: skip
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError(f"prompt_logprobs = {self.prompt_logprobs} with stream = true: "
                             "expected prompt_logprobs only without streaming (vLLM's rule); "
                             "echo with logprobs streams the prompt's")  # fmt: skip
        return self

    def token_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_top(self) -> int | None:
        """Top logprobs per prompt token (None: none): prompt_logprobs, else with echo the
        request's logprobs (vLLM's rule)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt alone is the answer (one token is generated
        and dropped, as vLLM does)."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(_Body):
    """One part of a message's content: text only (this server serves text models)."""

    model_config = ConfigDict(extra="allow")  # other part types carry other fields: named below

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> TextPart:
        if self.type != "text":
            raise ValueError(f"content part type {_short(self.type)} is not supported: "
                             "this server serves text models; expected 'text' parts")  # fmt: skip
        if self.text is None or self.model_extra:
            extra = sorted(self.model_extra or {})
            raise ValueError(f"a 'text' content part with text = {_short(self.text)} and "
                             f"other fields {extra}: expected {{'type': 'text', 'text': "
                             "<string>}")  # fmt: skip
        return self


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        """The content as one string: text parts joined by newlines, as vLLM joins them for
        a chat template that takes string content."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)

    def for_template(self) -> dict[str, str]:
        out = {"role": self.role, "content": self.text()}
        return out if self.name is None else out | {"name": self.name}


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: messages rendered by the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's current name
    metadata: dict[str, str] | None = None  # informational
    add_generation_prompt: bool = True  # vLLM's extension
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra template variables
    logprobs: bool = False  # each generated token's logprob (OpenAI's chat logprobs object)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: Any = None  # CHAT_UNSUPPORTED
    prompt_logprobs: Any = None  # CHAT_UNSUPPORTED

    _refused: ClassVar[dict[str, tuple]] = UNSUPPORTED | CHAT_UNSUPPORTED

    @model_validator(mode="after")
    def _one_limit(self) -> ChatCompletionRequest:
        both = (self.max_tokens, self.max_completion_tokens)
        if None not in both and both[0] != both[1]:
            raise ValueError(f"max_tokens = {both[0]} and max_completion_tokens = {both[1]} "
                             "disagree: expected one of them (max_completion_tokens is "
                             "OpenAI's current name)")  # fmt: skip
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError(f"top_logprobs = {self.top_logprobs} while logprobs is false: "
                             "expected logprobs = true with top_logprobs")  # fmt: skip
        return self

    def token_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's body): a `prompt`, or chat `messages` rendered by the chat
    template. add_special_tokens defaults as vLLM's: true for a prompt, false for messages
    (the template writes them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("expected exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's body)."""

    model: str | None = None
    tokens: list[int]


class LoadLoraRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)

    @model_validator(mode="after")
    def _no_nul(self) -> LoadLoraRequest:
        if "\x00" in self.lora_path or "\x00" in self.lora_name:
            raise ValueError("lora_name / lora_path holds a NUL character: expected a name "
                             "and a directory path")  # fmt: skip
        return self


class UnloadLoraRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's body carries it; names identify adapters here


def refusal(err: ValidationError | list[dict]) -> tuple[str, str]:
    """(message, param) of the first problem of a validation error: the field, the value
    received (shortened) and what was expected."""
    errors = err.errors() if isinstance(err, ValidationError) else err
    # our validators' own words first (a union reports every branch; the one that read the
    # value this far is the one with a value_error)
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    raw = first.get("loc", ())
    loc = [str(p) for p in raw if p != "body" and not _branch(p)]
    field = ".".join(loc) or "body"
    kind, msg = first.get("type", ""), first.get("msg", "")
    at = next((i for i, p in enumerate(raw) if _branch(p)), None)
    if kind != "value_error" and at is not None:  # no form of a union took the value
        forms = [e["loc"][at] for e in errors if len(e["loc"]) > at and e["loc"][:at] == raw[:at]]
        forms = list(dict.fromkeys(re.sub(r"function-after\[[^,]+, (\w+)\]", r"\1", f)
                                   for f in forms))  # fmt: skip
        return f"field '{field}' = {_short(first.get('input'))}: expected one of " + ", ".join(
            forms
        ), field
    if kind == "json_invalid":
        return f"invalid JSON body: {msg}", "body"
    if kind == "extra_forbidden":
        return (f"field '{field}' is not a field moelora serve reads: leave it out (the "
                "fields it serves and refuses are listed in docs/serve.md)"), field  # fmt: skip
    if kind == "value_error":  # our validators word the whole message
        msg = msg.removeprefix("Value error, ")
        if field == "body":  # a check across fields: its message opens with the field's name
            named = re.match(r"[a-z_]+", msg)
            field = named.group() if named and named.group() in _field_names() else field
        return msg, field
    return f"field '{field}' = {_short(first.get('input'))}: {msg}", field


def _field_names() -> set[str]:
    """Every field a request body may carry."""
    bodies = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
    return {name for body in bodies for name in body.model_fields} | {"n"}


def _branch(part: Any) -> bool:
    """A union branch's tag in an error location (`str`, `list[TextPart]`), not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _unpaired_surrogate(data: Any, path: str = "body") -> tuple[str, str] | None:
    """(field path, the surrogate) of the first string in `data`, keys included, that is not
    valid Unicode (JSON's escapes can spell a lone surrogate; no tokenizer takes one)."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError as err:
            return path, data[err.start]
        return None
    if isinstance(data, dict):
        items = [(str(k), v) for k, v in data.items()]
        keys = [(path, k) for k in data if isinstance(k, str)]
    elif isinstance(data, list):
        items, keys = [(str(i), v) for i, v in enumerate(data)], []
    else:
        return None
    for where, key in keys:
        found = _unpaired_surrogate(key, where)
        if found is not None:
            return found
    for key, value in items:
        found = _unpaired_surrogate(value, key if path == "body" else f"{path}.{key}")
        if found is not None:
            return found
    return None


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    """OpenAI's error object: {"error": {message, type, param, code}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    """A response id unique across processes and restarts (OpenAI's `cmpl-...` form)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def completion(
    rid: str, model: str, choices: list[dict], usage: dict, chat: bool
) -> dict[str, Any]:
    """A whole (non-streamed) response: one choice per {text, reason, logprobs and, when
    computed, prompt_logprobs}, indexed in order."""
    kind = "chat.completion" if chat else "text_completion"
    out = []
    for i, c in enumerate(choices):
        choice = _choice(i, c["text"], chat, whole=True)
        choice |= {"logprobs": c["logprobs"], "finish_reason": c["reason"]}
        if "prompt_logprobs" in c and not chat:
            choice["prompt_logprobs"] = c["prompt_logprobs"]
        out.append(choice)
    return _response(rid, kind, model, out) | {"usage": usage}


def chunk(
    rid: str,
    model: str,
    index: int,
    text: str,
    reason: str | None,
    chat: bool,
    first: bool = False,
    usage: dict | None = None,
    logprobs: dict | None = None,
) -> dict[str, Any]:
    """One server-sent event's body of a streamed response (choice `index`), with the
    logprobs of the tokens its text comes from."""
    choice = _choice(index, text, chat, whole=False, first=first)
    choice |= {"logprobs": logprobs, "finish_reason": reason}
    kind = "chat.completion.chunk" if chat else "text_completion"
    out = _response(rid, kind, model, [choice])
    return out if usage is None else out | {"usage": usage}


def usage_chunk(rid: str, model: str, chat: bool, usage: dict) -> dict[str, Any]:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return _response(rid, kind, model, []) | {"usage": usage}


def _choice(index: int, text: str, chat: bool, whole: bool, first: bool = False) -> dict:
    if not chat:
        return {"index": index, "text": text}
    if whole:
        return {"index": index, "message": {"role": "assistant", "content": text}}
    delta = {"role": "assistant", "content": text} if first else {"content": text}
    return {"index": index, "delta": delta}


def _response(rid: str, kind: str, model: str, choices: list[dict]) -> dict:
    """The fields every response and chunk share, in OpenAI's order."""
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
