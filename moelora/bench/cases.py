"""The benchmark case registry of `moelora bench`; shapes come from the model presets."""

from __future__ import annotations

from dataclasses import dataclass

TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
LARGE_MODEL_TOKENS = (1, 64, 1024, 4096, 16384)  # fewer points where one layer takes longer


@dataclass(frozen=True)
class BenchCase:
    """One model layer at one token count, LoRA with `adapters` slots of `rank`
    (token t uses slot t % adapters, as the vLLM peer does)."""

    model: str
    tokens: int
    adapters: int = 8
    rank: int = 16

    @property
    def id(self) -> str:
        return f"{self.model}/T={self.tokens}/L={self.adapters}/R={self.rank}"


CASES: dict[str, list[BenchCase]] = {
    # Issue 4's target layer: Qwen3-30B-A3B (E=128, K=8, H=2048, I=768), bf16, 8 x rank 16.
    "qwen3": [BenchCase("qwen3-30b-a3b", t) for t in TOKENS],
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
}
