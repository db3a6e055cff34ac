"""Per-request sampling for the decode engine: greedy, temperature, top-k, top-p, min-p,
repetition penalty, a seed per request, and the stop ids held back until min_new_tokens.

The steps are transformers' logits processors in generate's order (repetition penalty,
min-new-tokens, then temperature, top-k, top-p, min-p, softmax, one multinomial draw), so a
seeded request draws what `torch.manual_seed(seed); model.generate(do_sample=True, ...)`
draws for that row alone. Rows without a seed draw together from torch's global generator,
as generate does. A temperature below SAMPLING_EPS is greedy (vLLM's rule: dividing by it
would overflow). A row whose scores hold NaN or +inf, or whose probabilities do not form a
distribution (every token masked included), gets a SamplingFault instead of a token: it
fails alone, the other rows of the step keep theirs. A row with a TokenConstraint
(structured output) has the tokens it forbids masked before all of this (`constrain`), as
vLLM applies a grammar's bitmask before its sampler. Legend: B rows, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from ..errors import InputError

# vLLM's _SAMPLING_EPS: a temperature below it samples greedily (a division by it overflows)
SAMPLING_EPS = 1e-5
# what torch.Generator.manual_seed and vLLM take: a signed 64-bit integer
SEED_RANGE = (-(2**63), 2**63 - 1)


class TokenConstraint(Protocol):
    """A row's constraint on its next token (structured output): one object per request,
    stateful, called from the engine's thread only."""

    def allowed(self) -> Tensor:
        """allowed [V] bool: the tokens the next pick may take (on any device)."""
        ...

    def accept(self, token: int) -> None:
        """The row took `token` (one of allowed())."""
        ...

    @property
    def finished(self) -> bool:
        """Nothing may follow what was accepted but an end token: the row stops."""
        ...


class SamplingFault(Exception):
    """A row's scores gave no token (NaN or +inf logits, or no probability left): that row
    fails, with this as its error; the other rows of the step keep their tokens."""


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
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; over the prompt and the tokens generated
    logprobs: int | None = None  # each token's logprob and this many top ones (None: off)
    prompt_logprobs: int | None = None  # the same for every prompt token (None: off)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def check(self) -> None:
        """InputError naming the first field out of range (NaN is out of every range)."""
        low, high = SEED_RANGE
        rules = (
            ("max_new_tokens", self.max_new_tokens >= 1, "an integer >= 1"),
            ("temperature", self.temperature >= 0, "0 (greedy) or a positive float"),
            ("top_p", 0 < self.top_p <= 1, "a float in (0, 1]"),
            ("top_k", self.top_k >= 0, "0 (off) or a positive integer"),
            ("min_new_tokens", 0 <= self.min_new_tokens, "an integer >= 0"),
            ("min_p", 0 <= self.min_p <= 1, "a float in [0, 1]"),
            ("repetition_penalty", 0 < self.repetition_penalty < float("inf"),
             "a positive float (1 = off)"),
            ("seed", self.seed is None or low <= self.seed <= high,
             f"None or an integer in [{low}, {high}]"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "None or an integer >= 0"),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             "None or an integer >= 0"),
        )  # fmt: skip
        for name, ok, expected in rules:
            if not ok:
                raise InputError(f"sampling.{name}", repr(getattr(self, name)), expected)


@dataclass
class RowSampler:
    """One request's sampling state: its stop ids, with a seed its own generator, and with a
    repetition penalty the tokens it has seen (seen [V] bool: the prompt and its tokens)."""

    sampling: Sampling
    stop_ids: frozenset[int]
    generator: torch.Generator | None = field(default=None)
    seen: Tensor | None = field(default=None)
    constraint: TokenConstraint | None = field(default=None)

    @classmethod
    def make(
        cls,
        sampling: Sampling,
        eos_ids: frozenset[int],
        device,
        prompt: tuple[int, ...] = (),
        vocab: int = 0,
        constraint: TokenConstraint | None = None,
    ) -> RowSampler:
        stops = frozenset(sampling.stop_token_ids) | (
            frozenset() if sampling.ignore_eos else eos_ids
        )
        generator = None
        if sampling.seed is not None and not sampling.greedy:
            generator = torch.Generator(device=device).manual_seed(sampling.seed)
        seen = None
        if sampling.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            seen[list(prompt)] = True
        return cls(sampling, stops, generator, seen, constraint)

    def note(self, token: int) -> None:
        """The row produced `token` (the repetition penalty counts it from the next pick;
        a constraint advances over it)."""
        if self.seen is not None and token >= 0:
            self.seen[token] = True
        if self.constraint is not None and token >= 0:
            self.constraint.accept(token)

    @property
    def finished(self) -> bool:
        """Its constraint allows nothing more: the row stops (finish reason "stop")."""
        return self.constraint is not None and self.constraint.finished


def constrain(logits: Tensor, rows: list[RowSampler]) -> Tensor:
    """logits [B, V] with every constrained row's forbidden tokens at -inf (a copy when a
    row is constrained; `logits` itself otherwise)."""
    masked = [i for i, row in enumerate(rows) if row.constraint is not None]
    if not masked:
        return logits
    allowed = torch.stack([rows[i].constraint.allowed().to(logits.device) for i in masked])
    out = logits.clone()
    out[masked] = out[masked].masked_fill(~allowed, float("-inf"))
    return out


Picked = list  # one entry per row: a token id, or the row's SamplingFault


def next_tokens(logits: Tensor, rows: list[RowSampler], generated: list[int]) -> Picked:
    """logits [B, V] (any float dtype) -> per row a token id, or a SamplingFault when the
    row's scores give none; generated[i]: tokens row i has produced so far (stop ids are
    masked while it is below min_new_tokens)."""
    scores = logits.float()
    for i, (row, count) in enumerate(zip(rows, generated)):
        if row.seen is not None:  # HF's RepetitionPenaltyLogitsProcessor, generate's first
            penalty = row.sampling.repetition_penalty
            s = scores[i]
            scores[i] = torch.where(row.seen, torch.where(s < 0, s * penalty, s / penalty), s)
        if count < row.sampling.min_new_tokens and row.stop_ids:
            scores[i, sorted(row.stop_ids)] = float("-inf")
    # a row with NaN or +inf scores has no defined pick, greedy or sampled; nor one whose
    # every token is masked (a constraint that allows nothing)
    broken = scores.isnan().any(dim=-1) | scores.isposinf().any(dim=-1)
    broken |= scores.isneginf().all(dim=-1)
    picked = scores.argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.sampling.greedy]
    if sampled:
        probs = torch.stack([_probs(scores[i], rows[i].sampling) for i in sampled])
        # no distribution left (NaN, or every token removed): the row fails alone; it draws
        # from a placeholder (a bad distribution would stop the whole draw, on a GPU the
        # device) and its token is dropped below
        valid = probs.isfinite().all(dim=-1) & (probs.sum(dim=-1) > 0)
        probs = torch.where(valid[:, None], probs, torch.ones_like(probs))
        broken[sampled] = broken[sampled] | ~valid
        shared = [k for k, i in enumerate(sampled) if rows[i].generator is None]
        if shared:
            picked[[sampled[k] for k in shared]] = torch.multinomial(probs[shared], 1).squeeze(1)
        for k, i in enumerate(sampled):
            if rows[i].generator is not None:
                picked[i] = torch.multinomial(probs[k : k + 1], 1, generator=rows[i].generator)[
                    0, 0
                ]
    tokens, flags = torch.stack([picked, broken.long()]).tolist()  # one device -> host copy
    out: Picked = list(tokens)
    for i in (i for i, flag in enumerate(flags) if flag):
        out[i] = SamplingFault(
            f"row {i}: its logits hold NaN or +inf, or no token is left to sample "
            f"(temperature {rows[i].sampling.temperature}, top_p {rows[i].sampling.top_p}, "
            f"min_p {rows[i].sampling.min_p})"
        )
    return out


def _probs(scores: Tensor, sampling: Sampling) -> Tensor:
    """scores [V] -> probabilities [V] after temperature, top-k, top-p and min-p (HF's
    warpers, in generate's order)."""
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
    if sampling.min_p > 0:  # HF's MinPLogitsWarper: keep p >= min_p * the top p (and the top)
        probs = scores.softmax(dim=-1)
        drop = probs < sampling.min_p * probs.max()
        drop[probs.argmax()] = False
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)
