"""The grouped_mm backend's forward against the reference.

Its capability record (cuda sm90+, bf16) is covered GPU-free in test_oracle_tables.py. The
forward here runs on torch's CPU implementation of torch._grouped_mm (torch >= 2.9 has one),
calling the backend directly (the oracle would refuse a cpu deployment): the same sorting,
offsets, bias, LoRA and reduction code as on a GPU; only the GEMM kernel differs. The CUDA
kernel itself is exercised by `moelora validate --backends grouped_mm` on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from moelora.activations import Activation
from moelora.backends.grouped_mm import BACKEND
from moelora.call import MoECall
from moelora.compare import compare, poison_
from moelora.config import AddInputs, MoEShape
from moelora.reference import moe_lora_reference
from moelora.weights import random_expert_weights, random_lora_bank

# torch >= 2.8 (the floor in pyproject.toml) has torch._grouped_mm; no skip: a missing op fails.
T, H, INTER, E, K = 7, 16, 8, 4, 2  # legend T, H, I, E, K


def make_case(act, dtype, *, seed, bias=False, lora=True, ep_drop=False):
    shape = MoEShape(E, K, H, INTER, act, has_bias=bias, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).int()
    if ep_drop:  # expert parallel: ids outside [0, E) belong to other ranks
        ids[0, 0], ids[3, 1] = E + 2, -1
    weights = torch.rand(T, K, generator=gen)
    slots = torch.tensor([0, -1, 1, 1, -1, 0, 1], dtype=torch.int32)  # slot -1 rows included
    experts = random_expert_weights(shape, generator=gen)
    bank = random_lora_bank(shape, 2, 4, ranks=[4, 2], generator=gen) if lora else None
    return (x, ids, weights, slots, experts, bank, shape)


# (id, activation, dtype, knobs) — comments name the edge each covers.
CASES = [
    ("silu-fp32-lora", Activation.SILU, torch.float32, {}),  # gated, rank < R in slot 1
    ("silu-bf16-lora", Activation.SILU, torch.bfloat16, {}),  # the dtype the GPU runs
    ("swigluoai-bias", Activation.SWIGLUOAI, torch.float32, {"bias": True}),  # interleaved rows
    ("relu2-non-gated", Activation.RELU2_NO_MUL, torch.float32, {}),  # S = 1
    ("gelu-no-lora", Activation.GELU, torch.float32, {"lora": False}),  # base only
    ("silu-ep-drop", Activation.SILU, torch.float32, {"ep_drop": True}),  # non-local ids
]


@pytest.mark.parametrize("act, dtype, knobs", [pytest.param(*c[1:], id=c[0]) for c in CASES])
@pytest.mark.parametrize("weights_on_input", [False, True])
def test_grouped_mm_matches_reference(act, dtype, knobs, weights_on_input, seed):
    case = make_case(act, dtype, seed=seed, **knobs)
    ref = moe_lora_reference(*case, weights_on_input=weights_on_input)
    x, ids, w, slots, experts, bank, shape = case
    out = BACKEND.forward(MoECall(x, ids, w, slots, bank, weights_on_input), experts, shape)
    assert out.dtype == ref.dtype
    result = compare(out, ref, dtype)
    assert result.ok, str(result)


@pytest.mark.parametrize("add_inputs", list(AddInputs))
def test_grouped_mm_out_contract(add_inputs, seed):
    case = make_case(Activation.SILU, torch.float32, seed=seed)
    ref = moe_lora_reference(*case)
    prior = torch.randn_like(ref)
    buffer = prior.clone() if add_inputs is AddInputs.ADD else poison_(torch.empty_like(ref))
    x, ids, w, slots, experts, bank, shape = case
    call = MoECall(x, ids, w, slots, bank, out=buffer, add_inputs=add_inputs)
    out = BACKEND.forward(call, experts, shape)
    assert out is buffer
    expected = ref + prior if add_inputs is AddInputs.ADD else ref
    assert compare(out, expected, torch.float32).ok
