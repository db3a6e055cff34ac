"""An adapter parsed straight into a slot manager's host form (load_adapter(allocate=...):
bank dtype, every factor written once) holds the same bits as the fp32 form converted by the
host cache: b times its scale rounded once, the rank padding and untrained parts zero. Over
the fused layouts (both orientations, gpt-oss's interleaved gate/up, non-gated) and the
per-expert one, files in bf16 / fp16 / fp32, banks in bf16 / fp16 / fp32, a scale whose
products round."""

from __future__ import annotations

import adapter_files as af
import pytest
import torch

from moelora.lora import load_adapter
from moelora.lora.host_cache import HostCache

R, ALPHA = 4, 2.7  # scale 0.675: products of bf16 values round


def _factors(mc, seed: int, ranks: dict[str, int]) -> dict:
    """Random factors of rank R, the parts `ranks` names at that smaller rank."""
    out = af.known_factors(mc, R, seed=seed)
    return {(n, part): (a[:, : ranks.get(part, R)], b[:, :, : ranks.get(part, R)])
            for (n, part), (a, b) in out.items()}  # fmt: skip


CASES = [  # (id, model type, layout, orientation)
    ("fused-natural", "qwen3_moe", "fused", "natural"),
    ("fused-swapped", "qwen3_moe", "fused", "swapped"),
    ("fused-interleaved", "gpt_oss", "fused", "natural"),
    ("fused-non-gated", "nemotron_h", "fused", "natural"),
    ("per-expert", "qwen3_moe", "per_expert", None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("file_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_parsed_into_the_host_form_equals_the_converted_fp32_form(tmp_path, seed, case, file_dtype):
    _, model_type, layout, orientation = case
    mc = af.model_config(model_type, layers=3)
    # the per-expert layout takes a rank per part (down below R: padded); fused ones one rank
    factors = _factors(mc, seed, {"down": R - 1} if layout == "per_expert" else {})
    if layout == "fused":
        if mc.shape.activation.is_gated:  # one fused gate_up LoRA: gate and up share A
            for n in mc.moe_layers:
                factors[(n, "up")] = (factors[(n, "gate")][0], factors[(n, "up")][1])
        gpt_oss = model_type == "gpt_oss"
        tensors = af.fused_tensors(mc, factors, orientation, interleave=gpt_oss)
    else:
        tensors = af.per_expert_tensors(factors)
    tensors = {k: v.to(file_dtype) for k, v in tensors.items()}
    config = af.lora_config(R, ALPHA)
    if layout == "per_expert":
        config["rank_pattern"] = {"down_proj": R - 1}
    path = af.write_adapter(tmp_path / "ad", tensors, config)
    fp32 = load_adapter(path, mc, 8, fused_orientation=orientation if layout == "fused" else None)
    assert fp32.layers and all(t.dtype == torch.float32 for t in _flat(fp32))
    for bank_dtype in (torch.bfloat16, torch.float16, torch.float32):
        cache = HostCache(2, bank_dtype, pin=False)
        want = cache.convert(fp32)
        got = load_adapter(path, mc, 8, allocate=cache.allocate,
                           fused_orientation=orientation if layout == "fused" else None)  # fmt: skip
        assert cache.convert(got) is got  # already in the host form: no second copy
        assert got.rank == want.rank and sorted(got.layers) == sorted(want.layers)
        for g, w in zip(_flat(got), _flat(want), strict=True):
            assert g.dtype == bank_dtype and g.shape == w.shape
            assert torch.equal(g, w), (bank_dtype, (g != w).sum())
        assert all(bool(t.ne(0).any()) for t in _flat(got))  # no factor left all zero


def test_untrained_parts_and_rank_padding_are_zero_in_memory_that_was_not(tmp_path, seed):
    """The factors are allocated empty: what the adapter does not write must be zeroed
    however the memory was left (here every buffer handed out full of NaN)."""
    mc = af.model_config("qwen3_moe", layers=2)
    factors = {k: f for k, f in _factors(mc, seed, {"up": R - 2}).items() if k[1] != "gate"}
    config = {**af.lora_config(R, R), "rank_pattern": {"up_proj": R - 2}}
    path = af.write_adapter(tmp_path / "ad", af.per_expert_tensors(factors), config)

    def poisoned(sizes):
        return [torch.full(size, float("nan")) for size in sizes]

    got = load_adapter(path, mc, 8, allocate=poisoned)
    for layer, lora in got.layers.items():
        assert not any(
            bool(t.isnan().any()) for t in (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b)
        )
        assert not lora.w13_a[:, 0].any() and not lora.w13_b[:, 0].any()  # gate: untrained
        assert not lora.w13_a[:, 1, R - 2 :].any() and not lora.w13_b[:, 1, :, R - 2 :].any()
        a, _ = factors[(layer, "up")]
        assert torch.equal(lora.w13_a[:, 1, : R - 2], a)


def _flat(adapter) -> list[torch.Tensor]:
    return [getattr(lora, f) for _, lora in sorted(adapter.layers.items())
            for f in ("w13_a", "w13_b", "w2_a", "w2_b")]  # fmt: skip
