"""Per-request sampling for the decode engine: greedy, temperature, top-k, top-p, a seed per
request, and the stop ids held back until min_new_tokens.

The steps are transformers' logits processors in generate's order (min-new-tokens, then
temperature, top-k, top-p, softmax, one multinomial draw), so a seeded request draws what
`torch.manual_seed(seed); model.generate(do_sample=True, ...)` draws for that row alone.
Rows without a seed draw together from torch's global generator, as generate does.
Legend: B rows, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import InputError


@dataclass(frozen=True)
class Sampling:
    """How one request picks its tokens (vLLM's SamplingParams names)."""

    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-request torch.Generator when set
    stop_token_ids: tuple[int, ...] = ()  # besides the model's eos ids (unless ignore_eos)
    min_new_tokens: int = 0
    ignore_eos: bool = False

    def check(self) -> None:
        """InputError naming the first field out of range."""
        rules = (
            ("max_new_tokens", self.max_new_tokens >= 1, "an integer >= 1"),
            ("temperature", self.temperature >= 0, "0 (greedy) or a positive float"),
            ("top_p", 0 < self.top_p <= 1, "a float in (0, 1]"),
            ("top_k", self.top_k >= 0, "0 (off) or a positive integer"),
            ("min_new_tokens", 0 <= self.min_new_tokens, "an integer >= 0"),
        )
        for name, ok, expected in rules:
            if not ok:
                raise InputError(f"sampling.{name}", repr(getattr(self, name)), expected)


@dataclass
class RowSampler:
    """One request's sampling state: its stop ids and, with a seed, its own generator."""

    sampling: Sampling
    stop_ids: frozenset[int]
    generator: torch.Generator | None = field(default=None)

    @classmethod
    def make(cls, sampling: Sampling, eos_ids: frozenset[int], device) -> RowSampler:
        stops = frozenset(sampling.stop_token_ids) | (
            frozenset() if sampling.ignore_eos else eos_ids
        )
        generator = None
        if sampling.seed is not None and sampling.temperature > 0:
            generator = torch.Generator(device=device).manual_seed(sampling.seed)
        return cls(sampling, stops, generator)


def next_tokens(logits: Tensor, rows: list[RowSampler], generated: list[int]) -> list[int]:
    """logits [B, V] (any float dtype) -> one token id per row; generated[i]: tokens row i
    has produced so far (stop ids are masked while it is below min_new_tokens)."""
    scores = logits.float()
    for i, (row, count) in enumerate(zip(rows, generated)):
        if count < row.sampling.min_new_tokens and row.stop_ids:
            scores[i, sorted(row.stop_ids)] = float("-inf")
    picked = scores.argmax(dim=-1)
    shared = [i for i, row in enumerate(rows) if row.sampling.temperature > 0 and not row.generator]
    if shared:
        probs = torch.stack([_probs(scores[i], rows[i].sampling) for i in shared])
        picked[shared] = torch.multinomial(probs, 1).squeeze(1)
    for i, row in enumerate(rows):
        if row.generator is not None:
            probs = _probs(scores[i], row.sampling)[None]
            picked[i] = torch.multinomial(probs, 1, generator=row.generator)[0, 0]
    return picked.tolist()


def _probs(scores: Tensor, sampling: Sampling) -> Tensor:
    """scores [V] -> probabilities [V] after temperature, top-k and top-p (HF's warpers)."""
    scores = scores / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(scores, min(sampling.top_k, scores.shape[-1]))[0][-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - sampling.top_p)
        drop[-1:] = False  # HF keeps at least one token
        scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return scores.softmax(dim=-1)
