"""The per-token dense LoRA delta (E = 1, K = 1) against a per-token loop in fp32, and the
module banks' write and refusals."""

from __future__ import annotations

import pytest
import torch

from moelora.compare import assert_close
from moelora.errors import AdapterError
from moelora.lora.module_banks import ModuleBanks, ModuleLoRA, ModuleShape, dense_lora_delta

CASES = [
    # (id, T, L, R, N, M, slots: None = random in [-1, L), dtype)
    ("decode-mixed", 5, 4, 8, 32, 24, None, torch.float32),
    ("T-below-L", 2, 6, 4, 16, 40, None, torch.float32),
    ("every-slot-once", 4, 4, 2, 8, 8, [3, 0, 2, 1], torch.float32),
    ("all-base", 6, 3, 4, 16, 16, [-1] * 6, torch.float32),
    ("rank-1", 7, 2, 1, 12, 20, None, torch.float32),
    ("bf16", 9, 4, 8, 32, 48, None, torch.bfloat16),
]


def _loop(x, slots, a, bt):
    """ref [T, M]: one token at a time in fp32, (x_t @ a[s]^T) @ bt[s]; zero for slot -1."""
    out = torch.zeros(x.shape[0], bt.shape[-1])
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[t] = (x[t].float() @ a[s].float().T) @ bt[s].float()
    return out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dense_delta_equals_a_per_token_loop(case, seed):
    _, t, slots_n, rank, n, m, slots, dtype = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, generator=gen).to(dtype)
    a = torch.randn(slots_n, rank, n, generator=gen).to(dtype)
    bt = torch.randn(slots_n, rank, m, generator=gen).to(dtype)
    if slots is None:
        slots = torch.randint(-1, slots_n, (t,), generator=gen)
    slots = torch.as_tensor(slots, dtype=torch.int32)
    ref = _loop(x, slots, a, bt)
    out = dense_lora_delta(x, slots, a, bt)
    assert out.shape == (t, m) and out.dtype == dtype
    assert_close(out.float(), ref, dtype, what=case[0])
    base = slots < 0
    assert torch.equal(out[base], torch.zeros_like(out[base])), "slot -1 rows must be exactly 0"


def _banks():
    shapes = {"q": ModuleShape(8, 12, torch.device("cpu"), torch.float32)}
    return ModuleBanks(shapes, num_slots=2, max_rank=4)


def test_write_pads_rank_and_rewrites_a_slot_in_full(seed):
    gen = torch.Generator().manual_seed(seed)
    banks = _banks()
    full = ModuleLoRA(torch.randn(4, 8, generator=gen), torch.randn(12, 4, generator=gen))
    banks.write(1, {"q": full})
    small = ModuleLoRA(torch.randn(2, 8, generator=gen), torch.randn(12, 2, generator=gen))
    banks.write(1, {"q": small})  # rank 2 over rank 4: rows [2:] must be zero again
    assert torch.equal(banks.a["q"][1, :2], small.a) and not banks.a["q"][1, 2:].any()
    assert torch.equal(banks.bt["q"][1, :2], small.b.T) and not banks.bt["q"][1, 2:].any()
    assert not banks.a["q"][0].any()
    banks.write(1, {})  # an adapter without the module: the slot is zero
    assert not banks.a["q"].any() and not banks.bt["q"].any()


REFUSALS = [
    # (id, path, a shape, b shape, words)
    ("no-bank", "k", (2, 8), (12, 2), ["'k'", "lora_target_modules"]),
    ("wrong-in", "q", (2, 9), (12, 2), ["a [r, 8]"]),
    ("wrong-out", "q", (2, 8), (11, 2), ["b [12, r]"]),
    ("rank-above-R", "q", (5, 8), (12, 5), ["rank 5", "max_rank"]),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_check_refuses_before_any_write(case):
    _, path, a_shape, b_shape, words = case
    banks = _banks()
    lora = ModuleLoRA(torch.randn(a_shape), torch.randn(b_shape))
    with pytest.raises(AdapterError) as info:
        banks.check("adapter.safetensors", {path: lora})
    for word in words:
        assert word in str(info.value).replace('"', "'"), str(info.value)
