"""The benchmark case registry of `moelora bench`; shapes come from the model presets."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
LARGE_MODEL_TOKENS = (1, 64, 1024, 4096, 16384)  # fewer points where one layer takes longer


@dataclass(frozen=True)
class BenchCase:
    """One model layer at one token count, LoRA with `adapters` slots (token t uses slot
    t % adapters, as the vLLM peer does) in a bank of max rank `bank_rank` (default `rank`);
    every slot holds an adapter of real rank `rank`, or slot a one of ranks[a] (a mixed
    bank; each zero-padded up to the bank's rank). quantization: the experts' storage
    (`moelora --quantization`: none, fp8 ...; None: the model's own)."""

    model: str
    tokens: int
    adapters: int = 8
    rank: int = 16
    bank_rank: int | None = None
    ranks: tuple[int, ...] | None = None
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.ranks is not None and len(self.ranks) != self.adapters:
            raise ConfigError(
                "ranks",
                self.ranks,
                f"one real rank per slot ({self.adapters} adapters)",
                f"give {self.adapters} ranks, or leave ranks unset for every slot at rank",
            )
        bad = [r for r in self.slot_ranks if not 0 <= r <= self.max_rank]
        if bad:
            raise ConfigError(
                "ranks" if self.ranks is not None else "rank",
                self.ranks if self.ranks is not None else self.rank,
                f"real ranks in [0, {self.max_rank}] (the bank's rank)",
                f"raise bank_rank to at least {max(bad)}",
            )

    @property
    def max_rank(self) -> int:
        """R of the bank: every slot's factors are zero-padded up to it."""
        return self.rank if self.bank_rank is None else self.bank_rank

    @property
    def slot_ranks(self) -> tuple[int, ...]:
        """Each slot's real rank, [L]."""
        return self.ranks if self.ranks is not None else (self.rank,) * self.adapters

    @property
    def id(self) -> str:
        base = f"{self.model}/T={self.tokens}/L={self.adapters}/R={self.max_rank}"
        if self.quantization is not None:
            base += f"/{self.quantization}"
        ranks = self.slot_ranks
        if all(r == self.max_rank for r in ranks):
            return base
        uniform = len(set(ranks)) == 1
        return f"{base}/ranks={ranks[0] if uniform else ','.join(map(str, ranks))}"


QWEN3 = "qwen3-30b-a3b"
MIXED_RANKS = (8, 16, 64, 128, 8, 16, 64, 128)
LARGE_T = (4096, 16384)


def _qwen3(tokens: int, adapters: int = 8, rank: int = 16, **bank) -> BenchCase:
    return BenchCase(QWEN3, tokens, adapters, rank, **bank)


def _lora_sweep() -> list[BenchCase]:
    """Issue 19's sweep on the Qwen3-30B-A3B layer (bf16), uniform real ranks as the vLLM peer
    runs them unless a mixed bank is named; ordered so that a run cut short by its time
    limit has the reference config and the issue's targets first."""
    q = _qwen3
    cases = [q(t) for t in TOKENS]  # 8 x 16, the reference config
    cases += [q(t, 64) for t in (256, 4096, 16384)]
    cases += [q(t, rank=128) for t in (256, 4096, 16384)]
    # the same 8 rank-8 adapters padded to R = 128 and in an R = 8 bank (target: <= 1.15x)
    cases += [q(t, rank=8, bank_rank=128) for t in (256, 4096, 16384)]
    cases += [q(t, rank=8) for t in (256, 4096, 16384)]
    # a mixed bank against the rank-weighted mix of 8 x 8 / 16 / 64 / 128 (8 x 64 is new)
    cases += [q(t, rank=128, ranks=MIXED_RANKS) for t in LARGE_T]
    cases += [q(t, rank=64) for t in LARGE_T]
    cases += [q(t, 128) for t in (256, 4096)]
    cases += [q(t, rank=256) for t in (256, 4096)]
    return cases


CASES: dict[str, list[BenchCase]] = {
    # Issue 4's target layer: Qwen3-30B-A3B (E=128, K=8, H=2048, I=768), bf16, 8 x rank 16.
    "qwen3": [BenchCase(QWEN3, t) for t in TOKENS],
    "mixtral": [BenchCase("mixtral-8x7b", t) for t in LARGE_MODEL_TOKENS],
    "deepseek-v3": [BenchCase("deepseek-v3", t) for t in LARGE_MODEL_TOKENS],
    "qwen3.5": [BenchCase("qwen3.5-35b-a3b", t) for t in TOKENS],
    "olmoe-1b-7b": [BenchCase("olmoe-1b-7b", t) for t in LARGE_MODEL_TOKENS],
    "deepseek-v2-lite": [BenchCase("deepseek-v2-lite", t) for t in LARGE_MODEL_TOKENS],
    # Layers the vLLM peer cannot run (swigluoai with biases; non-gated relu2; routing
    # weights on the input): no peer column.
    "llama4-scout": [BenchCase("llama4-scout", t) for t in LARGE_MODEL_TOKENS],
    "gpt-oss-20b": [BenchCase("gpt-oss-20b", t) for t in LARGE_MODEL_TOKENS],
    "nemotron-h": [BenchCase("nemotron-h", t) for t in LARGE_MODEL_TOKENS],
    # Issue 19: many adapters, high rank, padded and mixed banks, beside the peer at each
    # (adapters, rank) (scripts/gpu_lora_sweep.sh; its table: benchmarks/lora_sweep_report.py)
    "lora-sweep": _lora_sweep(),
    # Issue 26: block-scaled FP8 experts beside bf16 on the same layer (the floor counts one
    # byte per FP8 weight plus its scales); bf16 first, so that each layer's experts are
    # built once per format (the runner keeps one set)
    "fp8-qwen3": [BenchCase(QWEN3, t, quantization=q) for q in ("none", "fp8") for t in TOKENS],
    "fp8-deepseek-v3": [
        BenchCase("deepseek-v3", t, quantization=q)
        for q in ("none", "fp8")
        for t in LARGE_MODEL_TOKENS
    ],
}
