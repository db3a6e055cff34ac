"""The layer cases of `moelora validate`: one `Case` per table row (T, the bank's slots and
rank, eager or graph replay, each slot's real rank, garbage past it), the default set, and
the case sets a layer suite adds (`--suite lora-sweep`, `--suite ranks`)."""

from __future__ import annotations

from dataclasses import dataclass

MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3", "nemotron-h", "gpt-oss-20b")
# On a cpu every kernel runs through Triton's interpreter: the two small presets (gated
# and non-gated), T = 1 (decode), 7 and 16, every case capped at the largest T: 9 cases per
# model, about 20 s for both on the shared 2-core CPU machine (with T 64: 30 s; the GPU
# defaults: hours).
CPU_MODELS = ("tiny", "tiny-relu2")
CPU_TOKENS = (1, 7, 16)
TOKENS = (1, 2, 7, 16, 64, 255, 1024, 4096, 16384)


@dataclass(frozen=True)
class Case:
    tokens: int
    adapters: int  # L; 0 = no LoRA bank (base path)
    rank: int  # R of the bank
    graphs: bool
    # each slot's real rank (zero-padded to R); None: alternating R and R/2 (build_lora)
    ranks: tuple[int, ...] | None = None
    garbage: bool = False  # the backend's bank holds garbage past each rank (inputs.py)

    def label(self) -> str:
        lora = f"L={self.adapters} R={self.rank}" if self.adapters else "no LoRA"
        if self.ranks is not None:
            lora += f" ranks={_ranks_text(self.ranks)}"
        padding = " garbage" if self.garbage else ""
        return f"T={self.tokens} {lora}{padding} {'graph' if self.graphs else 'eager'}"


def _ranks_text(ranks: tuple[int, ...]) -> str:
    """8 for (8,) * L, else every slot's rank (as the bench case ids write them)."""
    return str(ranks[0]) if len(set(ranks)) == 1 else ",".join(map(str, ranks))


def sweep_cases(tokens: tuple[int, ...], rank: int = 16) -> list[Case]:
    """The T sweep (--quick runs only this): 8 adapters of rank `rank`, eager."""
    return [Case(t, 8, rank, False) for t in tokens]


# Issue 19's banks (moelora bench --suite lora-sweep times them), each at these T
LORA_SWEEP_TOKENS = (2, 255, 4096)  # one token with an adapter; a partial block; prefill


def lora_sweep_cases() -> list[Case]:
    """--lora-sweep: a mixed bank (real ranks 8, 16, 64, 128 in an R = 128 bank), rank-8
    adapters padded to R = 128, 64 and 128 slots of R = 16 and 8 slots of R = 256 (these
    three alternating R and R/2, as build_lora makes them); eager."""
    banks = [
        (8, 128, (8, 16, 64, 128) * 2),
        (8, 128, (8,) * 8),
        (64, 16, None),
        (8, 256, None),
        (128, 16, None),
    ]
    return [
        Case(t, adapters, rank, False, ranks)
        for adapters, rank, ranks in banks
        for t in LORA_SWEEP_TOKENS
    ]


RANKS_TOKENS = (1, 7, 64, 1024, 4096)


def ranks_cases() -> list[Case]:
    """--suite ranks: banks whose columns past each slot's real rank hold garbage, eager
    and graph replay, against the reference on the clean bank: mixed ranks 8-128 in R =
    128, rank 8 in R = 128, rank 256 / 32, 64 slots of rank 16, and 128 slots of ranks 8 /
    16 with every other slot empty (rank 0)."""
    banks = [
        (128, (8, 16, 64, 128) * 2),
        (128, (8,) * 8),
        (256, (256, 32) * 4),
        (16, (16,) * 64),
        (16, tuple(0 if s % 2 else 8 if s % 4 else 16 for s in range(128))),
    ]
    return [
        Case(t, len(ranks), rank, graphs, ranks, garbage=True)
        for rank, ranks in banks
        for t in RANKS_TOKENS
        for graphs in (False, True)
    ]


# Case sets a layer suite adds to the table (--suite, repeatable)
LAYER_SUITES = {"lora-sweep": lora_sweep_cases, "ranks": ranks_cases}


def default_cases(tokens: tuple[int, ...] = TOKENS, rank: int = 16) -> list[Case]:
    cases = sweep_cases(tokens, rank)
    cases += [Case(t, 8, 16, True) for t in (1, 255, 4096) if t in tokens or len(tokens) > 3]
    cases += [Case(t, 8, r, False) for r in (8, 64, 128) for t in (64, 1024)]
    cases += [Case(t, 1, 16, False) for t in (7, 1024)]
    cases += [Case(16, 0, 16, False), Case(4096, 0, 16, True)]
    return cases
