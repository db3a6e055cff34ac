"""The triton backend on block-scaled FP8 experts (W8A8), under the interpreter on tiny
shapes, against the reference on the dequantized experts, which quantizes each base GEMM
input per token and group as the kernels must; scale blocks small enough that every GEMM
crosses several of them along N and K, with per-block magnitudes spread over 100x so that
a scale read from the wrong block fails; a kernel that skipped the activation quantization
(the weight-only product) fails; the kernels' quantization equals the reference's bit for
bit. Per-channel experts (whole-row activation scales) the same way."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from moelora import MoEShape, random_expert_weights, random_lora_bank
from moelora.backends.triton import BACKEND, forward_plan
from moelora.call import MoECall
from moelora.compare import assert_close, compare
from moelora.errors import InputError
from moelora.kernels.fp8_tiles import quantize_rows
from moelora.quant.activation_quant import quantize_activations
from moelora.quant.fp8_experts import quantize_experts
from moelora.quantization import QuantConfig, Quantization
from moelora.reference import reference_forward
from moelora.tiling.config import GemmTiles, TileConfig

FP8 = torch.float8_e4m3fn


def _spread(w: torch.Tensor, block: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """w [E, N, K] with each [bn, bk] block scaled by its own factor in [0.1, 10]."""
    e, n, k = w.shape
    nb, kb = -(-n // block[0]), -(-k // block[1])
    f = 10 ** (torch.rand(e, nb, kb, generator=g) * 2 - 1)
    full = f.repeat_interleave(block[0], 1).repeat_interleave(block[1], 2)[:, :n, :k]
    return w * full


def _problem(
    shape: MoEShape, quant: QuantConfig, tokens: int, slots: list[int], seed: int,
    weights_on_input: bool = False,
):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    full = random_expert_weights(shape, generator=g, dtype=torch.float32)
    # magnitudes spread per scale block, per row for per-channel scales
    spread = quant.block if quant.method is Quantization.FP8_BLOCK else (1, 1 << 20)
    full = dataclasses.replace(
        full, w13=_spread(full.w13, spread, g), w2=_spread(full.w2, spread, g)
    )
    fp8 = quantize_experts(full, quant)
    lora = random_lora_bank(shape, 2, 16, ranks=[16, 8], generator=g)
    x = torch.randn(tokens, shape.hidden_size, generator=g).to(shape.dtype)
    wts, ids = torch.randn(tokens, shape.num_experts, generator=g).softmax(-1).topk(shape.top_k)
    token_slots = torch.tensor(slots, dtype=torch.int32)
    call = MoECall(x, ids.int(), wts.float(), token_slots, lora, weights_on_input)
    return call, fp8


def _shape(
    act: str, dtype: torch.dtype, h: int = 96, i: int = 80, bias: bool = False, top_k: int = 2
):
    return MoEShape(4, top_k, h, i, act, has_bias=bias, dtype=dtype)


# fp32 inputs run exact fp32 sums, and the kernels quantize exactly as the reference: what
# is left is a GEMM input z summed in another order, whose e4m3 rounding can flip at a tie
# (one step, 2^-4 of an element: ~3e-3 of y at these shapes). The weight-only product (no
# activation quantization) is 2-5e-2 away, a scale from a wrong block far more.
W8A8_FP32 = 5e-3


def _tol(shape: MoEShape) -> float | None:
    """fp32: W8A8_FP32; 16-bit inputs: the FP8 row of the table (None)."""
    return W8A8_FP32 if shape.dtype == torch.float32 else None


B32 = QuantConfig(Quantization.FP8_BLOCK, (32, 32))
CHANNEL = QuantConfig(Quantization.FP8_CHANNEL)  # whole-row activation scales over K
# (id, shape, format, slots per token, weights_on_input) - which edge each covers
CASES = [
    ("silu_fp32_lora", _shape("silu", torch.float32), B32, [0, 1, -1, 0, 1], False),
    ("silu_bf16_lora", _shape("silu", torch.bfloat16), B32, [1, -1, 0, 0, 1], False),
    ("swigluoai_bias", _shape("swigluoai", torch.float32, bias=True), B32, [0, -1, 1], False),
    # interleaved gate / up rows read their own scale rows; biases in the epilogue
    ("relu2_nongated", _shape("relu2_no_mul", torch.float16), B32, [0, 1, -1, 1], False),
    ("partial_blocks", _shape("silu", torch.float32, h=72, i=40), B32, [0, -1, 1, 0, 0, 1],
     False),  # H, I not multiples of the block: the last groups and scale blocks are partial
    ("block_128_x_64", _shape("silu", torch.float32, h=160, i=128),
     QuantConfig(Quantization.FP8_BLOCK, (128, 64)), [0, 1, -1], False),  # BLOCK_K fitted to 64
    ("weights_on_input", _shape("silu", torch.float32, bias=True, top_k=1), B32,
     [0, -1, 1, 1], True),  # Llama-4: the reference quantizes the weighted x
    ("base_only", _shape("silu", torch.float32), B32, [-1, -1, -1], False),
    ("channel_fp32_lora", _shape("silu", torch.float32), CHANNEL, [0, 1, -1, 0, 1], False),
    ("channel_bf16_partial", _shape("silu", torch.bfloat16, h=72, i=40), CHANNEL,
     [1, -1, 0, 0], False),  # a row's scale over 72 columns: 3 K steps, the last partial
    ("channel_swigluoai_bias", _shape("swigluoai", torch.float32, bias=True), CHANNEL,
     [0, -1, 1], False),
    ("channel_weights_on_input", _shape("silu", torch.float32, top_k=1), CHANNEL,
     [0, -1, 1, 1], True),
]  # fmt: skip


@pytest.mark.parametrize("name,shape,quant,slots,on_input", CASES, ids=[c[0] for c in CASES])
def test_triton_fp8_block_matches_dequantized_reference(
    name, shape, quant, slots, on_input, seed
) -> None:
    call, fp8 = _problem(shape, quant, len(slots), slots, seed, on_input)
    out = BACKEND.forward(call, fp8, shape)
    ref = reference_forward(call, fp8.dequantize(), shape)
    assert_close(out, ref, FP8, tol=_tol(shape), what=name)


# (id, format, decode path) - both paths must quantize the GEMM inputs, by the format's groups
SKIP_CASES = [
    ("block_aligned", B32, False),
    ("block_decode", B32, True),
    ("channel_aligned", CHANNEL, False),
    ("channel_decode", CHANNEL, True),
]


@pytest.mark.parametrize("name,quant,decode", SKIP_CASES, ids=[c[0] for c in SKIP_CASES])
def test_kernels_that_skipped_the_activation_quantization_would_fail(
    name, quant, decode, seed
) -> None:
    """The weight-only product (e4m3 weights, full-precision inputs: what these kernels
    computed before W8A8) is far outside the tolerance the kernels meet; so is, for
    per-channel scales, quantizing by 32-column groups instead of whole rows."""
    from moelora.backends.triton import fused_moe_lora

    shape = _shape("silu", torch.float32)
    call, fp8 = _problem(shape, quant, 6, [0, 1, -1, 0, 1, -1], seed)
    out = fused_moe_lora(call, fp8, shape, config=DECODE if decode else None)
    dequantized = fp8.dequantize()
    assert_close(out, reference_forward(call, dequantized, shape), FP8, tol=W8A8_FP32, what=name)
    wrong = [QuantConfig()] + ([B32] if quant is CHANNEL else [])
    for other in wrong:
        ref = reference_forward(call, dataclasses.replace(dequantized, quantization=other), shape)
        skipped = compare(out, ref, tol=W8A8_FP32)
        assert skipped.rel_err > 2 * W8A8_FP32, (other, skipped)


# (id, format, decode path) - the gate/up LoRA seam on each path
SEAM_CASES = [
    ("block_aligned", B32, False),
    ("block_decode", B32, True),
    ("channel_aligned", CHANNEL, False),
]


@pytest.mark.parametrize("name,quant,decode", SEAM_CASES, ids=[c[0] for c in SEAM_CASES])
def test_lora_branch_reads_the_unquantized_x(name, quant, decode, seed) -> None:
    """vLLM #42007 in the kernels: with LoRA B factors 30x larger the delta dominates, so
    a kernel whose gate/up LoRA read the quantized x would match the reference run on
    x = q(x) (its base GEMM sees the same q(x): quantizing grid values again is exact)
    and miss the true one."""
    from moelora.backends.triton import fused_moe_lora
    from moelora.quant.activation_quant import base_gemm_input

    shape = _shape("silu", torch.float32)
    call, fp8 = _problem(shape, quant, 5, [0, 1, 0, 1, 0], seed)
    lora = dataclasses.replace(call.lora, w13_b=call.lora.w13_b * 30, w2_b=call.lora.w2_b * 30)
    call = dataclasses.replace(call, lora=lora)
    out = fused_moe_lora(call, fp8, shape, config=DECODE if decode else None)
    dequantized = fp8.dequantize()
    assert_close(out, reference_forward(call, dequantized, shape), FP8, tol=W8A8_FP32, what=name)
    quantized_x = dataclasses.replace(call, x=base_gemm_input(quant, call.x.float()))
    wrong = compare(out, reference_forward(quantized_x, dequantized, shape), tol=W8A8_FP32)
    assert wrong.rel_err > 2 * W8A8_FP32, wrong


@pytest.mark.parametrize("block_k", [128, 16], ids=["wider", "narrower"])
def test_fp8_plan_has_no_tma_and_steps_one_block(block_k, seed) -> None:
    shape = _shape("silu", torch.bfloat16)
    call, fp8 = _problem(shape, B32, 1, [0], seed)
    tiles = GemmTiles(block_n=64, block_k=block_k)
    for decode in (False, True):
        cfg = TileConfig(16, tiles, tiles, decode=decode, up_tma=True, down_tma=True)
        plan = forward_plan(call.x, call.topk_ids, fp8, call.lora, shape, config=cfg)
        assert plan.decode == decode and not plan.up.tma and not plan.down.tma
        assert plan.up.tiles.block_k == 32 and plan.down.tiles.block_k == 32


# (id, block) - K sides the K loop cannot step by
REFUSED_BLOCKS = [("k16", (32, 16)), ("k48", (32, 48)), ("k512", (128, 512))]


@pytest.mark.parametrize("name,block", REFUSED_BLOCKS, ids=[c[0] for c in REFUSED_BLOCKS])
def test_scale_block_the_kernels_cannot_step_by_is_refused(name, block) -> None:
    from moelora.errors import ConfigError
    from moelora.tiling.quantized import fit_to_fp8

    tiles = GemmTiles(64, 64)
    with pytest.raises(ConfigError) as err:
        fit_to_fp8(TileConfig(16, tiles, tiles), QuantConfig(Quantization.FP8_BLOCK, block))
    assert err.value.key == "quantization_config.weight_block_size"
    assert err.value.value == list(block) and "re-quantize" in str(err.value)


# (id, config, up / down BLOCK_K after the fit): a per-channel GEMM steps K by at least 32
# (the e4m3 tensor-core dot needs K >= 32: BLOCK_K 16 fails the sm_90 compile); the decode
# GEMVs keep theirs (fp32 register products)
CHANNEL_STEPS = [
    ("gemm-k16", TileConfig(16, GemmTiles(32, 16), GemmTiles(32, 16)), (32, 32)),
    ("gemm-k64", TileConfig(32, GemmTiles(64, 64), GemmTiles(64, 128)), (64, 128)),
    ("decode-k16", TileConfig(16, GemmTiles(16, 16), GemmTiles(16, 16), decode=True), (16, 16)),
]


@pytest.mark.parametrize("name,cfg,steps", CHANNEL_STEPS, ids=[c[0] for c in CHANNEL_STEPS])
def test_per_channel_gemm_steps_k_by_at_least_32(name, cfg, steps) -> None:
    from moelora.tiling.quantized import fit_to_fp8

    fitted = fit_to_fp8(cfg, CHANNEL)
    assert (fitted.up.block_k, fitted.down.block_k) == steps


DECODE = TileConfig(16, GemmTiles(16, 32), GemmTiles(16, 32), decode=True)
# a K step of 128 columns: 4 scale blocks of B32 along K, the scales applied to the input's
# columns (the rows of each program share a scale block)
WIDE = TileConfig(16, GemmTiles(16, 128), GemmTiles(16, 128), decode=True)
K16 = TileConfig(16, GemmTiles(16, 16), GemmTiles(16, 16), decode=True)
# the down GEMV's programs take 64 rows, two scale blocks of B32: it steps one block
WIDE_ROWS = TileConfig(16, GemmTiles(16, 128), GemmTiles(64, 128), decode=True)
# (id, shape, format, slots, early loads, tiles) - the decode GEMVs on FP8 rows
DECODE_CASES = [
    ("silu_lora", _shape("silu", torch.float32), B32, [0, -1, 1], False, DECODE),
    ("silu_early", _shape("silu", torch.float32), B32, [1, 0], True, DECODE),  # step 1 early
    ("swigluoai_bias", _shape("swigluoai", torch.float32, bias=True), B32, [0, -1], False,
     DECODE),
    ("relu2_partial", _shape("relu2_no_mul", torch.float32, h=72, i=40), B32, [-1, 1, 0], True,
     DECODE),
    ("wide_silu_early", _shape("silu", torch.float32), B32, [1, -1, 0], True, WIDE),
    ("wide_swigluoai_partial", _shape("swigluoai", torch.float32, h=72, i=48, bias=True), B32,
     [0, 1, -1], False, WIDE),  # K 72: a partial step over 3 blocks, the last one partial
    ("wide_bf16_lora", _shape("silu", torch.bfloat16), B32, [0, -1, 1, 1], False, WIDE),
    ("straddle_silu", _shape("silu", torch.float32, h=72, i=40), B32, [0, -1, 1], True,
     WIDE),  # I = 40: the up rows start mid-block, so the up GEMV steps one block
    ("wide_rows_down", _shape("silu", torch.float32), B32, [1, 0, -1], False, WIDE_ROWS),
    # steps narrower than a scale block: the columns' scales, a block over two steps
    ("k16_columns", _shape("silu", torch.float32), B32, [0, -1, 1], True, K16),
    ("channel_wide_partial", _shape("relu2_no_mul", torch.float32, h=72, i=40), CHANNEL,
     [1, 0, -1], False, WIDE),
    ("channel_early", _shape("silu", torch.float32), CHANNEL, [1, -1, 0], True, DECODE),
    ("channel_partial", _shape("relu2_no_mul", torch.float32, h=72, i=40), CHANNEL, [0, 1],
     False, DECODE),
]  # fmt: skip


@pytest.mark.parametrize(
    "name,shape,quant,slots,early,tiles", DECODE_CASES, ids=[c[0] for c in DECODE_CASES]
)
def test_decode_path_on_fp8_rows(name, shape, quant, slots, early, tiles, seed) -> None:
    from moelora.backends.triton import fused_moe_lora

    call, fp8 = _problem(shape, quant, len(slots), slots, seed)
    cfg = dataclasses.replace(tiles, pdl=early)
    out = fused_moe_lora(call, fp8, shape, config=cfg)
    ref = reference_forward(call, fp8.dequantize(), shape)
    assert_close(out, ref, FP8, tol=_tol(shape), what=name)


# a down GEMV of 4 rows per program: its step's two scale loads per column are not amortized
NARROW_DOWN = TileConfig(16, GemmTiles(16, 128), GemmTiles(4, 128), decode=True)
# (id, shape, config, up / down BLOCK_K after the fit to B32) - a decode GEMV keeps its step
# where each program's rows share a scale block (the down GEMV from COLUMN_ROWS rows), else
# steps one block
DECODE_STEPS = [
    ("shared", _shape("silu", torch.bfloat16), WIDE, (128, 128)),
    ("interleaved", _shape("swigluoai", torch.bfloat16, i=48), WIDE, (128, 128)),
    ("up_rows_mid_block", _shape("silu", torch.bfloat16, h=72, i=40), WIDE, (32, 128)),
    ("down_rows_two_blocks", _shape("silu", torch.bfloat16), WIDE_ROWS, (128, 32)),
    ("down_rows_few", _shape("silu", torch.bfloat16), NARROW_DOWN, (128, 32)),
    # interleaved gate / up rows: 32 units read 64 rows, two scale blocks of B32
    (
        "interleaved_two_blocks",
        _shape("swigluoai", torch.bfloat16, i=48),
        dataclasses.replace(WIDE, up=GemmTiles(32, 128)),
        (32, 128),
    ),
]


@pytest.mark.parametrize("name,shape,cfg,steps", DECODE_STEPS, ids=[c[0] for c in DECODE_STEPS])
def test_decode_gemv_keeps_its_step_where_rows_share_a_scale_block(
    name, shape, cfg, steps, seed
) -> None:
    call, fp8 = _problem(shape, B32, 1, [0], seed)
    plan = forward_plan(call.x, call.topk_ids, fp8, call.lora, shape, config=cfg)
    assert (plan.up.tiles.block_k, plan.down.tiles.block_k) == steps


# (id, block_n, row_step, up_offset, scale_n, shared) - the rows one decode GEMV program reads
SHARE_CASES = [
    ("stacked_aligned", 16, 1, 80, 32, True),  # up rows start at 80 = 5 x 16
    ("stacked_mid_block", 16, 1, 40, 32, False),  # up rows 40..55 straddle 32..63 and 64..
    ("interleaved", 16, 2, 1, 32, True),  # 32 rows from a multiple of 32
    ("interleaved_two_blocks", 32, 2, 1, 32, False),  # 64 rows: two blocks
    ("one_part_wide", 64, 1, 0, 32, False),
    ("one_part", 4, 1, 0, 128, True),
]


@pytest.mark.parametrize(
    "name,block_n,row_step,up_offset,scale_n,shared", SHARE_CASES,
    ids=[c[0] for c in SHARE_CASES],
)  # fmt: skip
def test_rows_share_scale_block(name, block_n, row_step, up_offset, scale_n, shared) -> None:
    from moelora.tiling.geometry import rows_share_scale_block

    assert rows_share_scale_block(block_n, row_step, up_offset, scale_n) is shared

    # and by enumeration: the gate rows of each of 8 programs in one block, and so the up
    # rows (up_offset after them; each set has its own scale row)
    def one_block(shift: int) -> bool:
        first = [p * block_n * row_step + shift for p in range(8)]
        return all(len({(f + i * row_step) // scale_n for i in range(block_n)}) == 1 for f in first)

    assert (one_block(0) and one_block(up_offset)) is shared


def test_gate_up_rows_of_each_layout() -> None:
    from moelora.tiling.geometry import gate_up_rows

    assert gate_up_rows(1, False, 768) == (1, 0)
    assert gate_up_rows(2, False, 768) == (1, 768)
    assert gate_up_rows(2, True, 768) == (2, 1)


def test_fp8_fit_without_the_layout_steps_one_block() -> None:
    """fit_to_fp8 told no inter (the layout unknown) keeps no wider decode step."""
    from moelora.tiling.quantized import fit_to_fp8

    fitted = fit_to_fp8(WIDE, B32)
    assert (fitted.up.block_k, fitted.down.block_k) == (32, 32)


def _layer(shape: MoEShape, quant: QuantConfig):
    from moelora.config import LoRAConfig
    from moelora.deployment import Deployment
    from moelora.device import probe
    from moelora.layer import MoELoRALayer
    from moelora.routing import RoutingConfig, RoutingMethod

    dep = Deployment(
        shape,
        RoutingConfig(RoutingMethod.SOFTMAX_TOPK),
        probe("cpu"),
        lora=LoRAConfig(enabled=True, max_rank=16, num_slots=2),
        backend="triton",
        quantization=quant,
    )
    return lambda experts: MoELoRALayer(dep, experts)


@pytest.mark.parametrize("quant", [B32, CHANNEL], ids=["block", "channel"])
def test_layer_runs_fp8_experts_and_base_rows_ignore_loaded_adapters(quant, seed) -> None:
    """vLLM #42008: base rows must not move when adapters are loaded. The same bank shape
    and tile rank, empty (rank 0) or loaded: slot -1 rows bit-identical."""
    shape = _shape("silu", torch.float32)
    call, fp8 = _problem(shape, quant, 6, [0, -1, 1, -1, 0, -1], seed)
    layer = _layer(shape, quant)(fp8)
    loaded = layer.forward(call.x, call.topk_ids, call.topk_weights, call.token_slots, call.lora)
    empty = dataclasses.replace(
        call.lora, ranks=torch.zeros(2, dtype=torch.int32), tile_rank=call.lora.tile_rank
    )
    unloaded = layer.forward(call.x, call.topk_ids, call.topk_weights, call.token_slots, empty)
    base = call.token_slots < 0
    assert torch.equal(loaded[base], unloaded[base])
    ref = reference_forward(call, fp8.dequantize(), shape)
    assert_close(loaded, ref, FP8, tol=W8A8_FP32, what="layer")
    assert not torch.equal(loaded[~base], unloaded[~base])  # the adapters did act


def test_layer_refuses_experts_not_in_its_format(seed) -> None:
    shape = _shape("silu", torch.float32)
    _, fp8 = _problem(shape, B32, 2, [0, 1], seed)
    with pytest.raises(InputError) as err:
        _layer(shape, QuantConfig())(fp8)  # a full-precision deployment given FP8 experts
    assert err.value.name == "experts"
    other_block = QuantConfig(Quantization.FP8_BLOCK, (64, 64))
    with pytest.raises(InputError):
        _layer(shape, other_block)(fp8)  # scales of another block size


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, COLS: tl.constexpr, GROUP: tl.constexpr):
    """Row program_id(0)'s group program_id(1) through fp8_tiles.quantize_rows."""
    offs_m = tl.program_id(0) + tl.zeros([1], tl.int32)
    offs_k = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    q, s = quantize_rows(tl.load(x_ptr + offs_m[:, None] * COLS + offs_k[None, :]))
    tl.store(q_ptr + offs_m[:, None] * COLS + offs_k[None, :], q)
    tl.store(s_ptr + offs_m[:, None] * (COLS // GROUP) + tl.program_id(1), s)


H200_SHARED = 232448  # bytes of shared memory per block on an H200 (sm_90)
# (id, BLOCK_M, up tiles, down tiles, expected stages up / down) - the FP8 pipeline refit;
# the bytes were measured in Triton's sm_90 compiles (fp8_pipeline_bytes)
STAGE_CASES = [
    ("bm32_4_stages_fit", 32, GemmTiles(128, 64, 8, 4), GemmTiles(256, 64, 8, 4), 4, 4),
    ("bm32_wide_up_refit", 32, GemmTiles(256, 64, 8, 4), GemmTiles(256, 64, 8, 4), 3, 4),
    ("bm16_wide_up_refit", 16, GemmTiles(512, 64, 8, 4), GemmTiles(128, 64, 4, 4), 1, 4),
]  # fmt: skip


@pytest.mark.parametrize(
    "name,block_m,up,down,up_stages,down_stages", STAGE_CASES, ids=[c[0] for c in STAGE_CASES]
)
def test_fp8_pipeline_is_refitted_to_shared_memory(
    name, block_m, up, down, up_stages, down_stages
) -> None:
    from moelora.tiling.quantized import fit_to_fp8, fp8_pipeline_bytes

    quant = QuantConfig(Quantization.FP8_BLOCK)
    cfg = TileConfig(block_m, up, down)
    fitted = fit_to_fp8(cfg, quant, parts=2, shared_memory=H200_SHARED)
    assert (fitted.up.num_stages, fitted.down.num_stages) == (up_stages, down_stages), name
    assert fp8_pipeline_bytes(block_m, fitted.up, 2) < H200_SHARED
    # 4 stages of [128, 128] e4m3 tiles: 196608 bytes in the up GEMM's sm_90 compile
    assert fp8_pipeline_bytes(128, GemmTiles(128, 128, 8, 4), 2) == 196608
    assert fit_to_fp8(cfg, quant).up.num_stages == up.num_stages  # no GPU: no refit


@pytest.mark.parametrize("block_m", [64, 128])
def test_fp8_gemms_from_block_m_64_take_the_measured_fp8_tiles(block_m) -> None:
    """The aligned path's FP8 GEMMs at BLOCK_M 64 and up run the tiles the H200 sweep chose
    (tiling/quantized.py), whatever bf16 row was picked; the decode GEMVs keep theirs."""
    from moelora.tiling.quantized import LARGE_DOWN, LARGE_M, LARGE_UP, fit_to_fp8

    cfg = TileConfig(block_m, GemmTiles(128, 64, 8, 4), GemmTiles(256, 64, 8, 4), up_tma=True)
    fitted = fit_to_fp8(cfg, QuantConfig(Quantization.FP8_BLOCK), shared_memory=H200_SHARED)
    assert (fitted.block_m, fitted.up, fitted.down) == (LARGE_M, LARGE_UP, LARGE_DOWN)
    assert not fitted.up_tma
    decode = dataclasses.replace(cfg, decode=True)
    assert fit_to_fp8(decode, QuantConfig(Quantization.FP8_BLOCK)).up.block_n == 128


def _rows_with_ties(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """x [rows, cols] fp32: random rows over 6 decades, one of them with amax 448 (scale 1)
    holding the midpoints between e4m3 neighbours (ties, subnormal ones too), one of zeros."""
    x = torch.randn(rows, cols, generator=g) * 10 ** (torch.rand(rows, 1, generator=g) * 6 - 3)
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0..448
    ties = (grid[:-1] + grid[1:]) / 2
    pick = ties[torch.randint(0, ties.numel(), (cols,), generator=g)]
    x[0] = pick * torch.where(torch.rand(cols, generator=g) < 0.5, -1.0, 1.0)
    x[0, 0] = 448.0
    x[1:2] = 0.0  # (a one-row x keeps the ties only)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_quantization_equals_the_reference_bit_for_bit(dtype, seed) -> None:
    """fp8_tiles.quantize_rows (every FP8 kernel's quantization) against
    quant.activation_quant: the same e4m3 bits and fp32 scales, ties and zeros included
    (the interpreter's own e4m3 conversion would fail this: fp8_tiles.E4M3_BY_GRID)."""
    rows, cols, group = 6, 128, 32
    x = _rows_with_ties(rows, cols, torch.Generator().manual_seed(seed)).to(dtype)
    q = torch.empty(rows, cols, dtype=FP8)
    s = torch.empty(rows, cols // group)
    _quantize_kernel[(rows, cols // group)](x, q, s, COLS=cols, GROUP=group)
    q_ref, s_ref = quantize_activations(x, group)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


# (id, rows, columns, group) - quant_rows' edges
QUANT_ROWS_CASES = [
    ("one_row", 1, 72, 32),  # a decode step's x: a 1-row program
    ("one_row_whole", 1, 300, None),
    ("partial_group_and_block", 37, 72, 32),  # 72 = 2 groups + 8 columns; 37 rows: 2 programs
    ("one_group_128", 5, 128, 128),
    ("whole_row", 37, 300, None),  # FP8_CHANNEL: 300 columns in 3 steps, one scale a row
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "name,rows,cols,group", QUANT_ROWS_CASES, ids=[c[0] for c in QUANT_ROWS_CASES]
)
def test_quant_rows_equals_the_reference_bit_for_bit(name, rows, cols, group, dtype, seed) -> None:
    from moelora.kernels.quant_rows import quant_rows

    x = _rows_with_ties(rows, cols, torch.Generator().manual_seed(seed)).to(dtype)
    q, s = quant_rows(x, group)
    q_ref, s_ref = quantize_activations(x, group)
    assert torch.equal(s, s_ref), name
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), name


SMALL = TileConfig(16, GemmTiles(32, 32), GemmTiles(32, 32))
# (id, shape, slots, weights_on_input, format) - the layer with its inputs quantized once
# per row before each base GEMM (quant_rows.py)
QUANTIZED_INPUT_CASES = [
    ("silu_lora", _shape("silu", torch.float32), [0, 1, -1, 0, 1], False, B32),
    ("bf16_partial", _shape("silu", torch.bfloat16, h=72, i=40), [1, -1, 0], False, B32),
    ("weights_on_input", _shape("silu", torch.float32, top_k=1), [0, -1, 1], True, B32),
    ("channel_whole_rows", _shape("silu", torch.float32, h=72, i=40), [0, -1, 1], False, CHANNEL),
]  # fmt: skip


@pytest.mark.parametrize(
    "name,shape,slots,on_input,quant",
    QUANTIZED_INPUT_CASES,
    ids=[c[0] for c in QUANTIZED_INPUT_CASES],
)
def test_inputs_quantized_before_the_gemms_equal_the_reference(
    name, shape, slots, on_input, quant, seed
) -> None:
    """x before the up GEMM and z before the down GEMM quantized once per row (per group,
    or the whole row per channel): the reference's W8A8 result, aligned and decode path."""
    from moelora.backends.triton import fused_moe_lora

    call, fp8 = _problem(shape, quant, len(slots), slots, seed, on_input)
    ref = reference_forward(call, fp8.dequantize(), shape)
    for config in (SMALL, dataclasses.replace(SMALL, decode=True)):
        out = fused_moe_lora(call, fp8, shape, config=config)
        assert_close(out, ref, FP8, tol=_tol(shape), what=f"{name} decode={config.decode}")
