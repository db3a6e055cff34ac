"""The shared input builders (moelora/inputs.py) that validate, bench, benchmarks/ and these
tests use: shapes, dtypes, the slot pattern and the adapters' ranks they promise."""

from __future__ import annotations

import pytest
import torch

from moelora.inputs import build_bank, build_experts, build_inputs, build_lora
from moelora.presets import resolve_model


@pytest.mark.parametrize("adapters", [0, 1, 3])
def test_inputs_follow_the_documented_conventions(adapters: int) -> None:
    model = resolve_model("tiny")
    s = model.shape
    x, ids, weights, slots = build_inputs(model, 9, adapters, "cpu", seed=2)
    assert x.shape == (9, s.hidden_size) and x.dtype == s.dtype
    assert ids.shape == weights.shape == (9, s.top_k)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    if not adapters:
        assert slots is None and build_lora(model, 0, 8, "cpu") is None
        return
    # token t -> (t + seed) % (L + 1) - 1: every (L+1)-th token has no adapter
    assert slots.tolist() == [(t + 2) % (adapters + 1) - 1 for t in range(9)]
    bank = build_lora(model, adapters, 8, "cpu")
    assert bank.num_slots == adapters and bank.w13_b.shape[-1] == 8
    # odd slots hold rank R/2, zero-padded to R
    if adapters > 1:
        assert torch.count_nonzero(bank.w13_a[1, :, :, 4:]) == 0
    again = build_inputs(model, 9, adapters, "cpu", seed=2)
    assert all(torch.equal(a, b) for a, b in zip((x, ids, weights, slots), again))


def test_experts_are_seeded() -> None:
    model = resolve_model("tiny")
    a, b = build_experts(model, "cpu", seed=1), build_experts(model, "cpu", seed=1)
    assert torch.equal(a.w13, b.w13) and a.w13.shape[0] == model.shape.num_experts


def test_bank_holds_each_slot_rank_zero_padded() -> None:
    bank = build_bank(resolve_model("tiny"), [8, 2, 0], 8, "cpu")
    assert bank.num_slots == 3 and bank.max_rank == 8
    for slot, rank in enumerate([8, 2, 0]):
        for factor, rank_dim in ((bank.w13_a, 3), (bank.w13_b, 4), (bank.w2_a, 2), (bank.w2_b, 3)):
            real = factor[slot].narrow(rank_dim - 1, 0, rank)
            padding = factor[slot].narrow(rank_dim - 1, rank, 8 - rank)
            assert torch.count_nonzero(padding) == 0
            assert rank == 0 or torch.count_nonzero(real) == real.numel()
