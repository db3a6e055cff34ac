"""What the HTTP app and run-batch share: the handle, the engine's scheduler, the tokenizer,
the served names, and the translation of an OpenAI body into engine Requests (one per
choice: `n` per prompt, prompt-major), checked here in the words the client used
(`max_tokens`, `--max-model-len`).

Errors a client can cause raise ServeError (HTTP status + OpenAI error type), whose message
names the field, the value and what was expected. `prepare` tokenizes: the app runs it off
the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..engine import Request, Sampling
from .metrics import Metrics
from .protocol import INT64, ChatCompletionRequest, CompletionRequest, SamplingFields, new_id
from .scheduler import Scheduler

# Characters of a text prompt tokenized first, per token of --max-model-len: a prompt whose
# first characters already make more tokens than the limit is refused without tokenizing the
# rest (a token rarely spans more than a few characters; 16 leaves a wide margin).
PREFIX_CHARS_PER_TOKEN = 16


class ServeError(Exception):
    """A refusal with its HTTP status and OpenAI error type."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def bad_request(message: str, param: str | None = None) -> ServeError:
    return ServeError(400, message, "BadRequestError", param)


@dataclass(frozen=True)
class Choice:
    """One choice of a response: its engine Request and what it shows besides the tokens."""

    request: Request
    first: bool  # the first choice of its prompt (the usage counts each prompt once)
    echo: str | None = None  # the prompt's text, shown before the completion (echo)
    echo_only: bool = False  # max_tokens 0 with echo: the one token generated is dropped
    top: int | None = None  # top logprobs per token (None: no logprobs)


@dataclass(frozen=True)
class Prepared:
    """An OpenAI body as the engine runs it: its choices (index = prompt * n + j, as vLLM
    numbers them), the stop strings, and whether it is a chat body."""

    choices: list[Choice]
    stop: tuple[str, ...]
    response_id: str
    chat: bool = False

    @property
    def requests(self) -> list[Request]:
        return [c.request for c in self.choices]


@dataclass
class ServeContext:
    handle: object  # moelora.hf.MoELoRAModel
    scheduler: Scheduler
    tokenizer: object
    served_model_name: str
    api_key: str | None = None
    runtime_lora: bool = False
    allowed_lora_root: Path | None = None  # runtime loads only below it (None: anywhere)
    parents: dict[str, str] = field(default_factory=dict)  # adapter -> base_model_name given
    metrics: Metrics = field(default_factory=Metrics)

    @property
    def models(self) -> list[str]:
        """The names a request's `model` may take: the base model, then every adapter."""
        return [self.served_model_name, *self.handle.adapters]

    @property
    def max_model_len(self) -> int:
        """The longest prompt + completion a request may have (--max-model-len)."""
        return self.scheduler.engine.max_len

    def adapter_of(self, model: str) -> str | None:
        """The adapter a request's `model` names (None: the base model); 404 otherwise."""
        if model == self.served_model_name:
            return None
        if model in self.handle.adapters:
            return model
        raise ServeError(
            404,
            f"model {model[:200]!r} does not exist: expected one of {self.models} (the base "
            "model or a loaded adapter; GET /v1/models lists them)",
            "NotFoundError",
            "model",
        )

    def prepare(self, body: SamplingFields) -> Prepared:
        """The engine Requests of an OpenAI body (`n` per prompt) and its stop strings."""
        adapter = self.adapter_of(body.model)
        chat = isinstance(body, ChatCompletionRequest)
        given = [None] if chat else body.prompts()
        prompts = [self._chat_ids(body)] if chat else [self._ids(p) for p in given]
        self._check_stop_ids(body)
        constraint = self._constraint_maker(body)
        rid = new_id("chatcmpl" if chat else "cmpl")
        echo = isinstance(body, CompletionRequest) and body.echo
        echo_only = echo and body.echo_only
        prompt_top = body.prompt_top() if isinstance(body, CompletionRequest) else None
        choices = []
        for i, (prompt, text) in enumerate(zip(prompts, given)):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            max_new = 1 if echo_only else self._max_new(body, len(prompt), where)
            for j in range(body.n):
                sampling = Sampling(
                    max_new_tokens=max_new,
                    temperature=body.temperature,
                    top_p=body.top_p,
                    top_k=max(body.top_k, 0),
                    min_p=body.min_p,
                    repetition_penalty=body.repetition_penalty,
                    seed=_choice_seed(body.seed, j),
                    stop_token_ids=tuple(body.stop_token_ids or ()),
                    min_new_tokens=body.min_tokens,
                    ignore_eos=body.ignore_eos,
                    logprobs=body.token_logprobs(),
                    prompt_logprobs=prompt_top,
                )
                made = None if constraint is None else constraint()
                request = Request(f"{rid}-{i * body.n + j}", tuple(prompt), adapter, sampling,
                                  made)  # fmt: skip
                shown = None
                if echo:
                    shown = text if isinstance(text, str) else self.tokenizer.decode(prompt)
                choices.append(Choice(request, j == 0, shown, echo_only, body.token_logprobs()))
        return Prepared(choices, body.stop_strings(), rid, chat)

    def _constraint_maker(self, body: SamplingFields):
        """A maker of one TokenConstraint per choice for the body's response_format (None:
        unconstrained); refusals (the package missing, a schema it cannot compile) are
        400s naming response_format."""
        if not body.constrained():
            return None
        from . import structured

        eos = getattr(self.tokenizer, "eos_token_id", None)
        stops = () if eos is None else (eos,)
        try:
            return structured.maker(body.response_format, self.tokenizer, self.vocab_size, stops)
        except structured.FormatRefused as err:
            raise bad_request(str(err), "response_format") from None

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (its logits' width; the tokenizer's may be smaller)."""
        return self.scheduler.engine.vocab_size

    def _max_new(self, body: SamplingFields, prompt_len: int, where: str) -> int:
        """The completion's token limit, checked against --max-model-len in API words."""
        room = self.max_model_len - prompt_len
        limit = body.completion_limit()
        if limit is None:
            if isinstance(body, ChatCompletionRequest):  # vLLM: the room the context leaves
                limit = room
            else:
                limit = 16  # OpenAI's default for completions
        if prompt_len + limit > self.max_model_len:
            name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else (
                "max_tokens")  # fmt: skip
            raise bad_request(
                f"{where} has {prompt_len} tokens and {name} = {limit}: {prompt_len + limit} "
                f"is more than this server's --max-model-len {self.max_model_len} (the longest "
                f"prompt + completion it runs): shorten the prompt or lower {name} (at most "
                f"{max(room, 0)} here)",
                "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            )
        return limit

    def _ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return self._checked_ids(prompt)
        return self._tokenize(prompt, add_special_tokens=True)

    def _tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`; a text whose first characters already exceed --max-model-len
        is refused before the rest is tokenized."""
        limit = self.max_model_len
        head = limit * PREFIX_CHARS_PER_TOKEN
        if len(text) > head:
            ids = self.tokenizer(text[:head], add_special_tokens=add_special_tokens)["input_ids"]
            if len(ids) > limit + 8:  # a margin for the token the cut may have split
                raise bad_request(
                    f"prompt has more than {limit} tokens (its first {head} characters make "
                    f"{len(ids)}): expected at most this server's --max-model-len {limit} "
                    "tokens, prompt and completion together",
                    "prompt",
                )
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        text = self.chat_text(body.messages, body.add_generation_prompt,
                              body.chat_template_kwargs)  # fmt: skip
        return self._tokenize(text, add_special_tokens=False)

    def chat_text(self, messages: list, add_generation_prompt: bool, kwargs: dict | None) -> str:
        """The chat template's rendering of `messages` (protocol.ChatMessage)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise bad_request(
                "this model's tokenizer has no chat template: expected one in "
                "tokenizer_config.json (chat_template) or the server started with "
                "--chat-template; or use /v1/completions with a prompt",
                "messages",
            )
        try:
            return self.tokenizer.apply_chat_template(
                [m.for_template() for m in messages],
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **(kwargs or {}),
            )
        except Exception as err:  # the template's own error (jinja raise_exception, ...)
            raise bad_request(
                f"the chat template refused these messages: {err}", "messages"
            ) from None

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text` (a text past --max-model-len refused early)."""
        return self._tokenize(text, add_special_tokens)

    def checked_ids(self, ids: list[int], field: str = "prompt") -> list[int]:
        """Token ids a client sent, refused (400 naming `field`) when out of the vocabulary."""
        vocab = len(self.tokenizer)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise bad_request(
                f"{field} token id {bad[0]} is out of range: expected 0 <= id < {vocab}", field
            )
        return ids

    def _checked_ids(self, ids: list[int]) -> list[int]:
        self.checked_ids(ids)
        if len(ids) > self.max_model_len:
            raise bad_request(
                f"prompt has {len(ids)} tokens: expected at most this server's --max-model-len "
                f"{self.max_model_len}, prompt and completion together",
                "prompt",
            )
        return ids

    def _check_stop_ids(self, body: SamplingFields) -> None:
        vocab = len(self.tokenizer)
        bad = [i for i in body.stop_token_ids or () if not 0 <= i < vocab]
        if bad:
            raise bad_request(
                f"stop_token_ids holds {bad[0]}: expected token ids in [0, {vocab})",
                "stop_token_ids",
            )


def _choice_seed(seed: int | None, j: int) -> int | None:
    """Choice j's seed: seed + j, as vLLM seeds a request's n samples (wrapped into the
    signed 64-bit range torch takes), so that every choice is reproducible and they differ."""
    if seed is None:
        return None
    low, high = INT64
    return (seed + j - low) % (high - low + 1) + low
