"""MoECall, the per-call record: what it refuses by itself (each case names the field the
InputError must name), and that a valid record is contiguous and sliced whole by head()."""

from __future__ import annotations

import pytest
import torch

from moelora.activations import Activation
from moelora.call import MoECall
from moelora.config import MoEShape
from moelora.errors import InputError
from moelora.weights import random_lora_bank

T, K, H = 6, 2, 16


def _fields(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(T, H, generator=gen),
        topk_ids=torch.randint(0, 4, (T, K), generator=gen, dtype=torch.int32),
        topk_weights=torch.rand(T, K, generator=gen),
        token_slots=torch.randint(-1, 2, (T,), generator=gen, dtype=torch.int32),
    )


# (id, how the fields are spoiled, the field the error names)
BAD = [
    ("x-1d", lambda f: f.update(x=f["x"][0]), "'x'"),  # x must be [T, H]
    ("ids-float", lambda f: f.update(topk_ids=f["topk_ids"].float()), "topk_ids"),
    ("ids-rows-differ", lambda f: f.update(topk_ids=f["topk_ids"][:3]), "topk_ids"),
    ("ids-1d", lambda f: f.update(topk_ids=f["topk_ids"][:, 0]), "topk_ids"),
    ("weights-k-differs", lambda f: f.update(topk_weights=f["topk_weights"][:, :1]), "weights"),
    ("weights-bf16", lambda f: f.update(topk_weights=f["topk_weights"].bfloat16()), "weights"),
    ("slots-int64", lambda f: f.update(token_slots=f["token_slots"].long()), "token_slots"),
    ("slots-rows-differ", lambda f: f.update(token_slots=f["token_slots"][:2]), "token_slots"),
    ("out-rows-differ", lambda f: f.update(out=torch.randn(T - 1, H)), "'out'"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_the_record_refuses_what_it_can_see(case, seed) -> None:
    fields = _fields(seed)
    MoECall(**fields)  # the unspoiled record builds
    case[1](fields)
    with pytest.raises(InputError, match=case[2]):
        MoECall(**fields)


def test_a_record_is_contiguous_and_head_keeps_the_rest(seed) -> None:
    fields = _fields(seed)
    ids = torch.randint(0, 4, (K, T), dtype=torch.int32).t()  # a transposed view
    bank = random_lora_bank(MoEShape(4, K, H, 8, Activation.SILU, dtype=torch.float32), 2, 4)
    out = torch.randn(T, 2 * H)[:, :H]  # a strided view: written in place, not copied
    call = MoECall(**{**fields, "topk_ids": ids}, lora=bank, weights_on_input=True, out=out)
    assert call.out is out and not call.adds
    assert not ids.is_contiguous() and call.topk_ids.is_contiguous()
    assert torch.equal(call.topk_ids, ids)
    head = call.head(4)
    assert head.num_tokens == 4 and head.top_k == K and head.has_lora
    assert head.lora is bank and head.weights_on_input
    for name in ("x", "topk_ids", "topk_weights", "token_slots", "out"):
        assert torch.equal(getattr(head, name), getattr(call, name)[:4]), name
    assert not MoECall(**{**fields, "token_slots": None}, lora=bank).has_lora
