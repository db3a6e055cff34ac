"""The reference against an independent per-token float64 loop written here (not shared
with moelora.reference), over a case table of activations, routings and slot patterns."""

from __future__ import annotations

import math

import pytest
import torch

from moelora import (
    Activation,
    MoEShape,
    RoutingConfig,
    RoutingMethod,
    moe_lora_reference,
    random_expert_weights,
    random_lora_bank,
    route,
)
from moelora.compare import assert_close


def _act64(kind: Activation, h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """Activation on one float64 row, written out from SPEC.md."""
    silu = lambda v: v / (1 + torch.exp(-v))  # noqa: E731
    gelu = lambda v: 0.5 * v * (1 + torch.erf(v / math.sqrt(2)))  # noqa: E731
    gelu_tanh = lambda v: 0.5 * v * (1 + torch.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))  # noqa: E731
    if kind is Activation.RELU2_NO_MUL:
        return torch.clamp(h, min=0) ** 2
    if kind is Activation.SILU_NO_MUL:
        return silu(h)
    if kind is Activation.GELU_NO_MUL:
        return gelu(h)
    if kind is Activation.SWIGLUOAI:
        gate, up = h[0::2].clamp(max=limit), h[1::2].clamp(-limit, limit)
        return (up + 1) * gate / (1 + torch.exp(-alpha * gate))
    i = h.shape[0] // 2
    unary = {Activation.SILU: silu, Activation.GELU: gelu, Activation.GELU_TANH: gelu_tanh}[kind]
    return unary(h[:i]) * h[i:]


def _loop64(x, ids, wts, slots, experts, lora, shape, weights_on_input):
    """y_t = sum_j g * (w2 @ act(w13 @ x + B13 A13 x) + B2 A2 z), token by token, float64."""
    d = torch.float64
    y = torch.zeros(x.shape[0], x.shape[1], dtype=d)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e, g, a = int(ids[t, j]), float(wts[t, j]), int(slots[t])
            xt = x[t].to(d) * (g if weights_on_input else 1.0)
            h = experts.w13[e].to(d) @ xt
            if experts.b13 is not None:
                h = h + experts.b13[e].to(d)
            if a >= 0:
                parts = [
                    lora.w13_b[a, e, s].to(d) @ (lora.w13_a[a, e, s].to(d) @ xt)
                    for s in range(shape.activation.width_factor)
                ]
                if shape.activation is Activation.SWIGLUOAI:
                    delta = torch.stack(parts, dim=1).reshape(-1)  # interleave gate, up
                else:
                    delta = torch.cat(parts)
                h = h + delta
            z = _act64(shape.activation, h, shape.swiglu_alpha, shape.swiglu_limit)
            o = experts.w2[e].to(d) @ z
            if experts.b2 is not None:
                o = o + experts.b2[e].to(d)
            if a >= 0:
                o = o + lora.w2_b[a, e].to(d) @ (lora.w2_a[a, e].to(d) @ z)
            y[t] += o if weights_on_input else g * o
    return y


def _shape(act: Activation, e: int = 6, k: int = 2, bias: bool = False) -> MoEShape:
    return MoEShape(e, k, 24, 20, act, has_bias=bias, dtype=torch.float32, swiglu_limit=1.5)


SOFTMAX = RoutingConfig(RoutingMethod.SOFTMAX_TOPK, renormalize=True)
# (id, shape, routing, T, slot pattern, ranks) — comment says which edge each covers.
CASES = [
    ("silu-mixed", _shape(Activation.SILU), SOFTMAX, 9, "mixed", [8, 8, 8]),
    ("gelu-all-slots", _shape(Activation.GELU), SOFTMAX, 7, "all", [8, 8, 8]),
    ("gelu_tanh-one-slot", _shape(Activation.GELU_TANH), SOFTMAX, 5, "one", [8]),
    # swigluoai: interleaved rows, clamp reached (limit 1.5), biases, top-k->softmax routing
    (
        "swigluoai-bias",
        _shape(Activation.SWIGLUOAI, bias=True),
        RoutingConfig(RoutingMethod.TOPK_SOFTMAX),
        11,
        "mixed",
        [8, 4],
    ),
    ("relu2-nongated", _shape(Activation.RELU2_NO_MUL), SOFTMAX, 6, "mixed", [8, 8]),
    ("silu-nongated", _shape(Activation.SILU_NO_MUL), SOFTMAX, 6, "mixed", [8, 8]),
    ("gelu-nongated", _shape(Activation.GELU_NO_MUL), SOFTMAX, 6, "mixed", [8, 8]),
    ("base-only", _shape(Activation.SILU), SOFTMAX, 5, "none", [8]),  # slot -1 only
    ("T1", _shape(Activation.SILU), SOFTMAX, 1, "all", [8]),  # a single token
    ("K1", _shape(Activation.SILU, k=1), SOFTMAX, 13, "mixed", [8, 8]),  # top-1
    ("K-eq-E", _shape(Activation.SILU, e=4, k=4), SOFTMAX, 7, "mixed", [8, 8]),  # every expert
    ("rank-below-R", _shape(Activation.SILU), SOFTMAX, 9, "mixed", [3, 1, 8]),  # zero padding
    (
        "no-renorm",
        _shape(Activation.SILU),
        RoutingConfig(RoutingMethod.SOFTMAX_TOPK),
        9,
        "mixed",
        [8],
    ),
    (
        "deepseek-v3",
        _shape(Activation.SILU, e=8, k=3),
        RoutingConfig(
            RoutingMethod.DEEPSEEK_V3,
            renormalize=True,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
        ),
        10,
        "mixed",
        [8, 8],
    ),
    (
        "deepseek-v2",
        _shape(Activation.SILU, e=8, k=3),
        RoutingConfig(
            RoutingMethod.DEEPSEEK_V2, n_group=4, topk_group=2, routed_scaling_factor=1.5
        ),
        10,
        "mixed",
        [8, 8],
    ),
    (
        "llama4-input-weight",
        _shape(Activation.SILU, k=1),
        RoutingConfig(RoutingMethod.LLAMA4),
        9,
        "mixed",
        [8, 8],
    ),
]


def _slots(pattern: str, tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    if pattern == "none":
        return torch.full((tokens,), -1, dtype=torch.int32)
    if pattern == "one":
        return torch.zeros(tokens, dtype=torch.int32)
    low = 0 if pattern == "all" else -1
    s = torch.randint(low, num_slots, (tokens,), generator=gen, dtype=torch.int32)
    if pattern == "mixed":  # make sure both -1 and every slot appear
        s[: num_slots + 1] = torch.arange(-1, num_slots, dtype=torch.int32)[:tokens]
    return s


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reference_matches_float64_loop(case, seed):
    _, shape, routing, tokens, pattern, ranks = case
    gen = torch.Generator().manual_seed(seed)
    experts = random_expert_weights(shape, generator=gen)
    lora = random_lora_bank(shape, len(ranks), 8, ranks=ranks, generator=gen)
    x = torch.randn(tokens, shape.hidden_size, generator=gen)
    ids, wts = route(torch.randn(tokens, shape.num_experts, generator=gen), routing, shape.top_k)
    slots = _slots(pattern, tokens, len(ranks), gen)
    on_input = routing.method.weights_on_input
    out = moe_lora_reference(x, ids, wts, slots, experts, lora, shape, weights_on_input=on_input)
    ref = _loop64(x, ids, wts, slots, experts, lora, shape, on_input)
    assert out.dtype == x.dtype
    assert_close(out, ref, torch.float32, what=case[0])
    if pattern != "none":  # the LoRA delta is visible: the check can fail
        base = _loop64(x, ids, wts, torch.full_like(slots, -1), experts, lora, shape, on_input)
        assert (out.double() - base).abs().max() > 1e-3


def test_slot_minus_one_rows_are_exactly_base(seed):
    shape = _shape(Activation.SILU)
    gen = torch.Generator().manual_seed(seed)
    experts = random_expert_weights(shape, generator=gen)
    lora = random_lora_bank(shape, 2, 8, generator=gen)
    x = torch.randn(8, shape.hidden_size, generator=gen)
    ids, wts = route(torch.randn(8, shape.num_experts, generator=gen), SOFTMAX, shape.top_k)
    slots = torch.tensor([-1, 0, 1, -1, 0, -1, 1, -1], dtype=torch.int32)
    out = moe_lora_reference(x, ids, wts, slots, experts, lora, shape)
    base = moe_lora_reference(x, ids, wts, None, experts, None, shape)
    rows = slots < 0
    assert torch.equal(out[rows], base[rows])
    assert not torch.allclose(out[~rows], base[~rows])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_reference_low_precision_inputs_accumulate_in_fp32(dtype, seed):
    shape = MoEShape(8, 2, 32, 16, Activation.SILU, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    experts = random_expert_weights(shape, generator=gen)
    lora = random_lora_bank(shape, 2, 4, generator=gen)
    x = torch.randn(12, 32, generator=gen).to(dtype)
    ids, wts = route(torch.randn(12, 8, generator=gen), SOFTMAX, 2)
    slots = torch.randint(-1, 2, (12,), generator=gen, dtype=torch.int32)
    out = moe_lora_reference(x, ids, wts, slots, experts, lora, shape)
    ref = _loop64(x, ids, wts, slots, experts, lora, shape, False)
    assert out.dtype == dtype
    assert_close(out, ref, dtype, what=str(dtype))


def test_expert_ids_outside_range_contribute_nothing(seed):
    """Expert parallel: ids of experts not held locally (here -1) add zero."""
    shape = _shape(Activation.SILU)
    gen = torch.Generator().manual_seed(seed)
    experts = random_expert_weights(shape, generator=gen)
    x = torch.randn(5, shape.hidden_size, generator=gen)
    ids, wts = route(torch.randn(5, shape.num_experts, generator=gen), SOFTMAX, shape.top_k)
    masked = ids.clone()
    masked[:, 1] = -1
    out = moe_lora_reference(x, masked, wts, None, experts, None, shape)
    ref = _loop64(x, ids[:, :1], wts[:, :1], torch.full((5,), -1), experts, None, shape, False)
    assert_close(out, ref, torch.float32)
