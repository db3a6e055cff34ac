"""The reference on FP8 experts against an fp64 token loop written here: both formats are
W8A8, each base GEMM input quantized per token (block-scaled: per group of the block's K
side; per-channel: the whole row), with the LoRA branch on the UNQUANTIZED activations; a
loop that feeds LoRA the quantized ones is shown to be caught; slot -1 rows are
bit-identical with and without adapters."""

from __future__ import annotations

import pytest
import torch

from moelora import MoEShape, moe_lora_reference, random_expert_weights, random_lora_bank
from moelora.compare import REL_TOL, assert_close, compare
from moelora.quant.fp8_experts import quantize_experts
from moelora.quantization import QuantConfig, Quantization

E4M3_MAX = 448.0
# The fp64 loop computes z in fp64, the reference in fp32: an element of z within ~1e-7 of an
# e4m3 rounding midpoint (or a group amax that moves its scale by that much) quantizes one
# step (2^-4 of that element) apart, which moves y. Over 300 seeds of each case below this
# put 1.5% of the comparisons past the fp32 row (1e-5), the largest at 6.9e-4; every wrong
# model (unquantized inputs, whole-row scales where groups are due, LoRA fed the quantized
# rows) was 1.3e-2 or more away. So the loop is held to this, and each wrong model must fail it.
W8A8_TOL = 2e-3


def _quant_row64(v: torch.Tensor, group: int | None) -> torch.Tensor:
    """One token's row through e4m3, each group of `group` columns (None: the whole row)
    with its own scale amax / 448 (fp32, as the format stores it), back in fp64."""
    width = v.numel() if group is None else group
    parts = []
    for start in range(0, v.numel(), width):
        g = v[start : start + width]
        scale = (g.abs().max().float().clamp(min=1e-12) / E4M3_MAX).double()
        parts.append(
            (g / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double() * scale
        )
    return torch.cat(parts)


def _loop64(
    x,
    ids,
    wts,
    slots,
    experts,
    lora,
    w8a8: bool,
    group: int | None = None,
    lora_sees_quantized: bool = False,
):
    """y_t = sum_j g (w2 q(z) + B2 A2 z'), z = silu(gate) * up of (w13 q(x) + B13 A13 x'),
    q = per-token (per-group) e4m3 under W8A8 (identity otherwise); x' = x, z' = z unless
    the LoRA branch is (wrongly) fed the quantized rows."""
    d, i = torch.float64, experts.w2.shape[2]
    y = torch.zeros(x.shape[0], x.shape[1], dtype=d)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e, g, a = int(ids[t, j]), float(wts[t, j]), int(slots[t])
            xt = x[t].to(d)
            xq = _quant_row64(xt, group) if w8a8 else xt
            x_lora = xq if lora_sees_quantized else xt
            h = experts.w13[e].to(d) @ xq
            if a >= 0:
                h = h + torch.cat(
                    [
                        lora.w13_b[a, e, s].to(d) @ (lora.w13_a[a, e, s].to(d) @ x_lora)
                        for s in range(2)
                    ]
                )
            z = torch.nn.functional.silu(h[:i]) * h[i:]
            zq = _quant_row64(z, group) if w8a8 else z
            o = experts.w2[e].to(d) @ zq
            if a >= 0:
                o = o + lora.w2_b[a, e].to(d) @ (
                    lora.w2_a[a, e].to(d) @ (zq if lora_sees_quantized else z)
                )
            y[t] += g * o
    return y  # fmt: skip


def _inputs(shape: MoEShape, tokens: int, quant: QuantConfig, seed: int):
    g = torch.Generator().manual_seed(seed)
    fp8 = quantize_experts(random_expert_weights(shape, generator=g, dtype=torch.float32), quant)
    lora = random_lora_bank(shape, 3, 8, ranks=[8, 5, 8], generator=g, dtype=torch.float32)
    x = torch.randn(tokens, shape.hidden_size, generator=g)
    logits = torch.randn(tokens, shape.num_experts, generator=g)
    wts, ids = logits.softmax(-1).topk(shape.top_k, dim=-1)
    slots = torch.randint(-1, 3, (tokens,), generator=g, dtype=torch.int32)
    slots[0] = -1  # at least one base row
    return x, ids.to(torch.int32), wts.float(), slots, fp8.dequantize(), lora


def _shape(h: int, i: int) -> MoEShape:
    return MoEShape(5, 2, h, i, "silu", dtype=torch.float32)


# (id, shape, format, T) - which edge each covers
CASES = [
    ("block_128_whole", _shape(256, 256), QuantConfig(Quantization.FP8_BLOCK), 9),
    ("block_partial", _shape(160, 96), QuantConfig(Quantization.FP8_BLOCK, (64, 128)), 7),
    # partial blocks on both axes, a non-square block: x in groups of 128 + 32, z one of 96
    ("block_32_T1", _shape(96, 64), QuantConfig(Quantization.FP8_BLOCK, (32, 32)), 1),
    # many groups per row (3 of x, 2 of z), one token
    ("channel_w8a8", _shape(256, 128), QuantConfig(Quantization.FP8_CHANNEL), 9),
    ("channel_T1", _shape(128, 64), QuantConfig(Quantization.FP8_CHANNEL), 1),  # one token
]  # fmt: skip


@pytest.mark.parametrize("name,shape,quant,tokens", CASES, ids=[c[0] for c in CASES])
def test_reference_equals_fp64_loop_on_dequantized_fp8(name, shape, quant, tokens, seed) -> None:
    x, ids, wts, slots, experts, lora = _inputs(shape, tokens, quant, seed)
    out = moe_lora_reference(x, ids, wts, slots, experts, lora, shape)
    group = quant.activation_group
    ref = _loop64(x, ids, wts, slots, experts, lora, True, group)
    assert_close(out, ref, torch.float32, tol=W8A8_TOL, what=name)
    # the activation quantization is modelled: full-precision inputs are far off
    unquantized = _loop64(x, ids, wts, slots, experts, lora, w8a8=False)
    assert compare(out, unquantized, tol=REL_TOL[torch.float32]).rel_err > W8A8_TOL
    if group is not None and group < shape.hidden_size:  # and by groups, not whole rows
        whole_rows = _loop64(x, ids, wts, slots, experts, lora, True, None)
        assert compare(out, whole_rows, tol=REL_TOL[torch.float32]).rel_err > W8A8_TOL


# (id, format, T) - the LoRA seam under each W8A8 format
SEAM_CASES = [
    ("channel_T9", QuantConfig(Quantization.FP8_CHANNEL), 9),
    ("channel_T1", QuantConfig(Quantization.FP8_CHANNEL), 1),
    ("block_T9", QuantConfig(Quantization.FP8_BLOCK, (64, 64)), 9),  # 4 groups of x, 2 of z
]


@pytest.mark.parametrize("name,quant,tokens", SEAM_CASES, ids=[c[0] for c in SEAM_CASES])
def test_lora_branch_fed_quantized_activations_is_caught(name, quant, tokens, seed) -> None:
    """vLLM #42007: feeding LoRA the quantized rows must fail against the reference."""
    shape = _shape(256, 128)
    x, ids, wts, _, experts, lora = _inputs(shape, tokens, quant, seed)
    slots = torch.zeros(tokens, dtype=torch.int32)  # every row through slot 0
    out = moe_lora_reference(x, ids, wts, slots, experts, lora, shape)
    group = quant.activation_group
    wrong = _loop64(x, ids, wts, slots, experts, lora, True, group, lora_sees_quantized=True)
    assert not compare(out, wrong, tol=W8A8_TOL).ok, name  # the wrong seam is visible
    right = _loop64(x, ids, wts, slots, experts, lora, True, group)
    assert_close(out, right, torch.float32, tol=W8A8_TOL, what=name)


@pytest.mark.parametrize(
    "quant",
    [QuantConfig(Quantization.FP8_BLOCK), QuantConfig(Quantization.FP8_CHANNEL)],
    ids=["block", "channel"],
)
def test_base_rows_bit_identical_with_and_without_adapters(quant, seed) -> None:
    shape = _shape(256, 128)
    x, ids, wts, slots, experts, lora = _inputs(shape, 12, quant, seed)
    with_lora = moe_lora_reference(x, ids, wts, slots, experts, lora, shape)
    without = moe_lora_reference(x, ids, wts, None, experts, None, shape)
    base = slots < 0
    assert torch.equal(with_lora[base], without[base])
    assert not torch.equal(with_lora[~base], without[~base])  # the adapters did act


def test_group_scales_of_no_rows_keep_their_group_count() -> None:
    """An expert no token reached: [0, K] rows give [0, G] scales (no reshape error)."""
    from moelora.quant.activation_quant import group_scales

    assert group_scales(torch.randn(0, 200), 128).shape == (0, 2)
    assert group_scales(torch.randn(0, 200), None).shape == (0, 1)
