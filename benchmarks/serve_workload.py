"""The load benchmark's workload (benchmarks/serve_load.py): prompt and output lengths drawn
from distributions named on the command line, adapter names drawn with Zipf-like popularity,
Poisson arrivals, all from one seeded generator, so a level's LoRA-free and adapter runs get
the same arrivals (the same times, prompts and lengths; only the `model` field differs)."""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass


class Shape(str, enum.Enum):
    FIXED = "fixed"  # fixed:N
    UNIFORM = "uniform"  # uniform:LO:HI, both included
    LOGNORMAL = "lognormal"  # lognormal:MEDIAN:SIGMA:MAX, clipped to [1, MAX]


SPELLING = {Shape.FIXED: "fixed:N", Shape.UNIFORM: "uniform:LO:HI",
            Shape.LOGNORMAL: "lognormal:MEDIAN:SIGMA:MAX"}  # fmt: skip


@dataclass(frozen=True)
class Lengths:
    """A length distribution: `low` is fixed's N, uniform's LO or lognormal's median;
    `high` the largest length drawn (fixed: N)."""

    shape: Shape
    low: int
    high: int
    sigma: float = 0.0

    @classmethod
    def parse(cls, text: str, flag: str) -> Lengths:
        """'uniform:64:512' -> Lengths; ValueError naming the flag and the forms."""
        kind, *parts = text.split(":")
        forms = ", ".join(SPELLING.values())
        try:
            shape = Shape(kind)
            if len(parts) != SPELLING[shape].count(":"):
                raise ValueError
            if shape is Shape.LOGNORMAL:
                out = cls(shape, int(parts[0]), int(parts[2]), float(parts[1]))
            else:
                out = cls(shape, int(parts[0]), int(parts[-1]))
        except ValueError:
            raise ValueError(f"{flag} {text!r}: expected one of {forms}") from None
        if not 1 <= out.low <= out.high or out.sigma < 0:
            raise ValueError(f"{flag} {text!r}: lengths must be >= 1 with LO <= HI "
                             "(MEDIAN <= MAX) and SIGMA >= 0")  # fmt: skip
        return out

    def draw(self, rng: random.Random) -> int:
        if self.shape is Shape.FIXED:
            return self.low
        if self.shape is Shape.UNIFORM:
            return rng.randint(self.low, self.high)
        return max(1, min(self.high, round(self.low * math.exp(rng.gauss(0.0, self.sigma)))))


def popularity(count: int, exponent: float) -> list[float]:
    """Zipf-like weights of `count` names: name i drawn with probability ~ (i + 1)^-exponent
    (exponent 0: uniform; 1: the classic Zipf law of web and adapter traffic)."""
    weights = [(i + 1) ** -exponent for i in range(count)]
    total = sum(weights)
    return [w / total for w in weights]


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the level starts
    prompt: tuple[int, ...]  # token ids
    output: int  # max_tokens (ignore_eos: the tokens generated)
    adapter: str  # the name an adapter run sends; a LoRA-free run sends the base model's


@dataclass(frozen=True)
class Workload:
    rate: float  # Poisson arrivals, requests/s
    prompt: Lengths
    output: Lengths
    names: tuple[str, ...]  # adapter names, most popular first
    zipf: float
    vocab: int  # token ids drawn from [1, vocab)


def arrivals(work: Workload, count: int, rng: random.Random) -> list[Arrival]:
    """`count` arrivals of `work`, in time order."""
    weights = popularity(len(work.names), work.zipf)
    out, t = [], 0.0
    for _ in range(count):
        prompt = tuple(rng.randrange(1, work.vocab) for _ in range(work.prompt.draw(rng)))
        adapter = rng.choices(work.names, weights)[0]
        out.append(Arrival(t, prompt, work.output.draw(rng), adapter))
        t += rng.expovariate(work.rate)
    return out
