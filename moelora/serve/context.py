"""What the HTTP app and run-batch share: the handle, the engine's scheduler, the tokenizer,
the served names, and the translation of an OpenAI body into an engine Request.

Errors a client can cause raise ServeError (HTTP status + OpenAI error type), whose message
names the field, the value and what was expected.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ..hf.engine import Request, Sampling
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from .scheduler import Scheduler


class ServeError(Exception):
    """A refusal with its HTTP status and OpenAI error type."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


@dataclass
class ServeContext:
    handle: object  # moelora.hf.MoELoRAModel
    scheduler: Scheduler
    tokenizer: object
    served_model_name: str
    api_key: str | None = None
    runtime_lora: bool = False
    metrics: Metrics = field(default_factory=Metrics)
    _ids: itertools.count = field(default_factory=itertools.count)

    @property
    def models(self) -> list[str]:
        """The names a request's `model` may take: the base model, then every adapter."""
        return [self.served_model_name, *self.handle.adapters]

    def adapter_of(self, model: str) -> str | None:
        """The adapter a request's `model` names (None: the base model); 404 otherwise."""
        if model == self.served_model_name:
            return None
        if model in self.handle.adapters:
            return model
        raise ServeError(
            404,
            f"model {model!r} does not exist: expected one of {self.models} (the base model or "
            "a loaded adapter; GET /v1/models lists them)",
            "NotFoundError",
            "model",
        )

    def request(self, body: SamplingFields) -> tuple[Request, tuple[str, ...]]:
        """The engine Request of an OpenAI body, and its stop strings."""
        adapter = self.adapter_of(body.model)
        prompt = self._prompt_ids(body)
        if not prompt:
            raise ServeError(
                400, "prompt is empty: expected at least one token", "BadRequestError", "prompt"
            )
        if body.max_tokens is not None:
            max_new = body.max_tokens
        elif isinstance(body, ChatCompletionRequest):  # vLLM: the room the context leaves
            max_new = max(1, self.scheduler.engine.max_len - len(prompt))
        else:
            max_new = 16  # OpenAI's default for completions
        sampling = Sampling(
            max_new_tokens=max_new,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            seed=body.seed,
            min_new_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos,
        )
        rid = (
            f"{'chatcmpl' if isinstance(body, ChatCompletionRequest) else 'cmpl'}-{next(self._ids)}"
        )
        return Request(rid, tuple(prompt), adapter, sampling), body.stop_strings()

    def _prompt_ids(self, body: SamplingFields) -> list[int]:
        if isinstance(body, CompletionRequest):
            if isinstance(body.prompt, list):
                return self._checked_ids(body.prompt)
            return list(self.tokenizer(body.prompt)["input_ids"])
        messages = [m.model_dump(include={"role", "content"}) for m in body.messages]
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ServeError(
                400,
                "this model's tokenizer has no chat template: expected one in "
                "tokenizer_config.json (chat_template) for /v1/chat/completions; use "
                "/v1/completions with a prompt instead",
                "BadRequestError",
                "messages",
            )
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _checked_ids(self, ids: list[int]) -> list[int]:
        vocab = len(self.tokenizer)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ServeError(
                400,
                f"prompt token id {bad[0]} is out of range: expected 0 <= id < {vocab}",
                "BadRequestError",
                "prompt",
            )
        return ids
