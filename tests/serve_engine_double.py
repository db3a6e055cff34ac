"""A TEST DOUBLE of moelora.hf.engine.Engine (docs: the engine contract), for the server
tests while the real engine is on its own branch: every step recomputes each row's whole
sequence with one forward of the handle (no KV cache), one row per call, so each row is
exactly HF's computation of that prompt alone. Slots and rows are limited as the real
engine's admissible() says. Not part of moelora.

When moelora.hf.engine is missing, `install()` puts a module with the contract's dataclasses
in its place (field for field as the contract gives them), so moelora.serve imports.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import torch

from moelora.errors import InputError


def install() -> None:
    try:
        import moelora.hf.engine  # noqa: F401
    except ModuleNotFoundError:
        sys.modules["moelora.hf.engine"] = _contract_module()


def _contract_module() -> types.ModuleType:
    module = types.ModuleType("moelora.hf.engine")

    @dataclasses.dataclass(frozen=True)
    class Sampling:
        max_new_tokens: int = 16
        temperature: float = 0.0
        top_p: float = 1.0
        top_k: int = 0
        seed: int | None = None
        stop_token_ids: tuple[int, ...] = ()
        min_new_tokens: int = 0
        ignore_eos: bool = False

    @dataclasses.dataclass(frozen=True)
    class Request:
        request_id: str
        prompt_ids: tuple[int, ...]
        adapter: str | None
        sampling: Sampling = Sampling()

    @dataclasses.dataclass(frozen=True)
    class TokenEvent:
        request_id: str
        token_id: int
        finished: bool
        finish_reason: str | None

    module.Sampling, module.Request, module.TokenEvent = Sampling, Request, TokenEvent
    module.Engine = RecomputeEngine
    return module


class RecomputeEngine:
    """The engine contract by recomputation (see the module docstring)."""

    def __init__(self, handle, *, max_rows=64, max_len=None, enforce_eager=None) -> None:
        self.handle, self.max_rows = handle, max_rows
        self.max_len = max_len or handle.model.config.max_position_embeddings
        self._rows: dict[str, list] = {}  # id -> [request, tokens, generator]
        self._new: list = []
        self._cancelled: set[str] = set()
        self.steps = 0
        self.most_rows = 0  # the largest batch a step ran (tests read it)

    def check(self, request) -> None:
        if request.adapter is not None and request.adapter not in self.handle.adapters:
            raise InputError("adapter", repr(request.adapter), f"one of {self.handle.adapters}")
        if not request.prompt_ids:
            raise InputError("prompt_ids", "empty", "at least one token")
        total = len(request.prompt_ids) + request.sampling.max_new_tokens
        if total > self.max_len:
            raise InputError("prompt + max_new_tokens", total, f"at most max_len = {self.max_len}")

    def admissible(self, request) -> str | None:
        if len(self._rows) + len(self._new) >= self.max_rows:
            return "no free row"
        adapters = {r[0].adapter for r in [*self._rows.values(), *self._new]} - {None}
        if (
            request.adapter is not None
            and len(adapters | {request.adapter}) > self.handle.max_loras
        ):
            return "every adapter slot is held by running requests of other adapters"
        return None

    def add(self, request) -> None:
        gen = None
        if request.sampling.seed is not None:
            gen = torch.Generator().manual_seed(request.sampling.seed)
        self._new.append([request, [], gen])

    def cancel(self, request_id: str) -> None:
        self._cancelled.add(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self._rows or self._new or self._cancelled)

    @property
    def running(self) -> int:
        return len(self._rows)

    def step(self) -> list:
        from moelora.hf.engine import TokenEvent

        events = []
        for row in self._new:
            self._rows[row[0].request_id] = row
        self._new = []
        for rid in self._cancelled & set(self._rows):
            del self._rows[rid]
            events.append(TokenEvent(rid, -1, True, "cancelled"))
        self._cancelled.clear()
        self.steps += 1
        self.most_rows = max(self.most_rows, len(self._rows))
        for rid, (request, tokens, gen) in list(self._rows.items()):
            token = self._next(request, tokens, gen)
            tokens.append(token)
            s = request.sampling
            stop = (
                token in s.stop_token_ids and not s.ignore_eos and len(tokens) >= s.min_new_tokens
            )
            done = stop or len(tokens) >= s.max_new_tokens
            if done:
                del self._rows[rid]
            events.append(
                TokenEvent(rid, token, done, ("stop" if stop else "length") if done else None)
            )
        return events

    def _next(self, request, tokens, gen) -> int:
        ids = torch.tensor([[*request.prompt_ids, *tokens]], device=self.handle.device)
        logits = self.handle(ids, adapter_names=[request.adapter]).logits[0, -1].float()
        s = request.sampling
        if s.temperature == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits / s.temperature, dim=-1)
        return int(torch.multinomial(probs.cpu(), 1, generator=gen))
