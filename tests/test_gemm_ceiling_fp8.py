"""gemm_ceiling --fp8 without a GPU: the quantized operands dequantize to the bf16 ones, the
fp8 rows count the bf16 rows' FLOPs, every call passes torch's own layout checks on meta
tensors of the same strides, the rowwise dense call (torch runs it on CPU) matches the bf16
GEMM, and a failing or wrong variant becomes an "unavailable" row, not an exception."""

from __future__ import annotations

import pytest
import torch

from benchmarks.ceiling_operands import Variant, build_operands
from benchmarks.fp8_operands import fp8_variants, quantize_operands
from benchmarks.gemm_ceiling import bf16_variants, run_variant
from moelora.compare import REL_TOL, compare
from moelora.config import from_hf

E4M3 = torch.float8_e4m3fn
# H and I multiples of 128 (the block variants' K), E = 4 experts, P = 2 * 40 pairs.
MODEL = from_hf(
    {
        "model_type": "qwen3_moe", "hidden_size": 256, "moe_intermediate_size": 128,
        "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "hidden_act": "silu", "num_hidden_layers": 1, "torch_dtype": "bfloat16",
    },
    name="ceiling-fp8",
)  # fmt: skip
TOKENS = 40
# Against the bf16 GEMM both operands carry an independent e4m3 rounding (3 mantissa bits,
# about 2.5% rms each: sqrt(2) x that measured 3.6% here), twice the table's one-side row;
# a wrong layout or scale is off by O(1).
W8A8_TOL = 2 * REL_TOL[torch.float8_e4m3fn]


@pytest.fixture(scope="module")
def built():
    torch.manual_seed(1234)
    ops = build_operands(MODEL, TOKENS, "cpu")
    q = quantize_operands(ops)
    return ops, q, fp8_variants(ops, q)


def _never_timed(fn, static, iters):
    raise AssertionError("a variant that failed its check was timed")


def _fake_timer(fn, static, iters):
    fn(*static)
    return 2.0, "fake"


# (id, quantized operand, the bf16 operand it stands for): each comment says which scale.
QUANT_CASES = [
    ("rows_rowwise", lambda q: q.rows.dequantized(), lambda o: o.rows),  # one scale a row
    ("z_rowwise", lambda q: q.z.dequantized(), lambda o: o.z),
    ("rows_1x128", lambda q: q.rows_block.dequantized(), lambda o: o.rows),  # 2 groups a row
    ("z_1x128", lambda q: q.z_block.dequantized(), lambda o: o.z),  # 1 group a row
    ("w13_channel", lambda q: q.channel.dequantize().w13, lambda o: o.experts.w13),  # [E, N]
    ("w2_channel", lambda q: q.channel.dequantize().w2, lambda o: o.experts.w2),
    ("w13_128x128", lambda q: q.block.dequantize().w13, lambda o: o.experts.w13[:1]),  # expert 0
    ("w2_128x128", lambda q: q.block.dequantize().w2, lambda o: o.experts.w2[:1]),
]


@pytest.mark.parametrize("case", QUANT_CASES, ids=[c[0] for c in QUANT_CASES])
def test_quantized_operands_dequantize_to_the_bf16_ones(built, case) -> None:
    _, deq, orig = case
    ops, q, _ = built
    out, ref = deq(q), orig(ops).float()
    result = compare(out, ref, E4M3)
    assert result.ok, result
    assert result.rel_err > 0  # it was quantized (an e4m3 rounding happened)


def test_fp8_rows_count_the_bf16_rows_flops(built) -> None:
    ops, _, fp8 = built
    bf16 = bf16_variants(ops)
    for name in ("grouped up", "grouped down", "grouped both", "dense up", "dense down"):
        assert fp8[f"fp8 {name}"].flops == bf16[name].flops, name
    assert fp8["fp8 dense block up"].flops == bf16["dense up"].flops
    assert fp8["fp8 dense block down"].flops == bf16["dense down"].flops
    assert bf16["grouped up"].flops == 2.0 * TOKENS * 2 * 256 * (2 * 128)


def _on_meta(t):
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


# (variant, output shape [P, N]): P = 80 pairs, N = 2I = 256 (up) or H = 256 (down).
META_CASES = [
    ("fp8 grouped up", [(80, 256)]),  # _scaled_grouped_mm: 2D rows x 3D column-major experts
    ("fp8 grouped down", [(80, 256)]),  # K = I = 128
    ("fp8 grouped both", [(80, 256), (80, 256)]),
    ("fp8 dense up", [(80, 256)]),  # _scaled_mm rowwise: [P, 1] x [1, N]
    ("fp8 dense down", [(80, 256)]),
    ("fp8 dense block up", [(80, 256)]),  # 1x128 x 128x128: K/128 = 2 padded to L4 = 4
    ("fp8 dense block down", [(80, 256)]),  # K/128 = 1, the stride-1 single-column scale_a
]


@pytest.mark.parametrize("case", META_CASES, ids=[c[0] for c in META_CASES])
def test_every_call_passes_torchs_layout_checks(built, case) -> None:
    name, shapes = case
    v = built[2][name]
    out = v.fn(*[_on_meta(t) for t in v.static])
    outs = out if isinstance(out, tuple) else (out,)
    assert [tuple(o.shape) for o in outs] == shapes
    assert all(o.dtype == torch.bfloat16 for o in outs)


def test_a_wrong_layout_fails_torchs_check(built) -> None:
    """The meta check has teeth: row-major experts (no transpose) are refused."""
    v = built[2]["fp8 grouped up"]
    static = list(v.static)
    static[1] = static[1].contiguous()  # [E, K, N] row-major instead of column-major
    with pytest.raises(RuntimeError, match="column major"):
        v.fn(*[_on_meta(t) for t in static])


@pytest.mark.parametrize("name", ["fp8 dense up", "fp8 dense down"])
def test_rowwise_dense_on_cpu_matches_the_bf16_gemm(built, name, capsys) -> None:
    """torch runs rowwise _scaled_mm on CPU: its output against the fp32 GEMM of the bf16
    operands (an outside truth), then through run_variant's own dequantized check."""
    ops, _, fp8 = built
    v = fp8[name]
    a, w = (ops.rows, ops.experts.w13[0]) if name.endswith("up") else (ops.z, ops.experts.w2[0])
    result = compare(v.fn(*v.static), a.float() @ w.float().T, tol=W8A8_TOL)
    assert result.ok, result
    row = run_variant(name, v, 3, timer=_fake_timer)
    assert row["rel_err"] <= REL_TOL[torch.bfloat16] and row["ms"] == 2.0, row
    assert row["tflops"] == pytest.approx(v.flops / 2e-3 / 1e12)


def test_a_failing_variant_is_an_unavailable_row(capsys) -> None:
    def fn(x):
        raise NotImplementedError("no FP8 grouped GEMM for sm_80\nsecond line")

    row = run_variant("fp8 grouped up", Variant(fn, (torch.randn(4, 4),), 1.0), 3, _fake_timer)
    assert row == {"error": "NotImplementedError: no FP8 grouped GEMM for sm_80"}
    printed = capsys.readouterr().out
    assert "  fp8 grouped up: unavailable (NotImplementedError: no FP8 grouped GEMM" in printed


def test_a_wrong_result_is_refused_before_timing(built, capsys) -> None:
    """Expert 1's weight where expert 0's belongs: the dequantized check catches it."""
    v = built[2]["fp8 dense up"]
    wrong = Variant(v.fn, (v.static[0], built[1].channel.w13[1].t(), *v.static[2:]), v.flops, v.ref)
    row = run_variant("fp8 dense up", wrong, 3, _never_timed)
    assert row["error"].startswith("ValueError: output against the dequantized fp32 GEMM")
    assert "unavailable (ValueError" in capsys.readouterr().out


CHECKED = ["fp8 grouped up", "fp8 grouped down", "fp8 dense up", "fp8 dense down"]
CHECKED += ["fp8 dense block up", "fp8 dense block down"]


@pytest.mark.parametrize("name", CHECKED)
def test_each_reference_is_the_bf16_gemm_at_its_rows(built, name) -> None:
    """The refs run_variant checks the GPU calls against (the grouped ones find each row's
    expert from offs) against the bf16 operands' GEMM, each row's expert from the counts."""
    ops, _, fp8 = built
    ids, expected = fp8[name].ref()
    up = name.endswith("up")
    a, w = (ops.rows, ops.experts.w13) if up else (ops.z, ops.experts.w2)
    counts = torch.diff(ops.offs, prepend=ops.offs.new_zeros(1))
    expert = torch.repeat_interleave(torch.arange(len(counts)), counts.long())
    if "dense" in name:
        expert = torch.zeros_like(expert)  # the dense rows all use expert 0's weight
    assert len(expert.unique()) > 1 or "dense" in name  # the routing spreads over experts
    truth = torch.einsum("pk,pnk->pn", a[ids].float(), w[expert[ids]].float())
    result = compare(expected, truth, tol=W8A8_TOL)
    assert result.ok, result
    assert len(ids) == a.shape[0]  # fewer pairs than CHECK_ROWS: every row checked
