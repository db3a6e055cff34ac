"""The FP8 bench suite and floor: bf16 and FP8 rows of the same layers, T by T, and the
floor counting one byte per FP8 weight plus its scales (counted here by hand)."""

from __future__ import annotations

import pytest
import torch

from moelora.bench.cases import CASES
from moelora.bench.floors import layer_work


@pytest.mark.parametrize(
    "suite,model", [("fp8-qwen3", "qwen3-30b-a3b"), ("fp8-deepseek-v3", "deepseek-v3")]
)
def test_fp8_suites_pair_bf16_and_fp8_rows(suite, model) -> None:
    cases = CASES[suite]
    assert len({c.id for c in cases}) == len(cases)
    pairs = {}
    for c in cases:
        pairs.setdefault((c.model, c.tokens), set()).add(c.quantization)
    assert all(q == {"none", "fp8"} for q in pairs.values())
    assert {m for m, _ in pairs} == {model}


# (id, T, E hit, weight bytes per element) - the floor's expert bytes scale with the format
FLOOR_CASES = [
    ("bf16", 4, None),
    ("fp8_block_128", 4, 1 + 4 / (128 * 128)),
    ("fp8_T1", 1, 1 + 4 / (128 * 128)),
]


def test_floor_counts_fp8_weight_bytes() -> None:
    h, i, parts = 256, 128, 2
    for name, tokens, weight_bytes in FLOOR_CASES:
        ids = torch.randint(0, 16, (tokens, 4))
        work = layer_work(ids, None, h, i, parts, 16, lora=False, weight_bytes=weight_bytes)
        hit = torch.unique(ids).numel()
        per_weight = 2 if weight_bytes is None else weight_bytes
        want = per_weight * (parts + 1) * h * i * hit + 2 * 2 * tokens * h  # x read, y written
        assert abs(work.bytes - want) < 1e-6 * want, name
        assert work.flops == 2.0 * tokens * 4 * (parts + 1) * h * i  # FLOPs do not change
