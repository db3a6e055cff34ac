"""The triton backend on block-scaled FP8 experts, under the interpreter on tiny shapes,
against the reference on the dequantized experts (the FP8 row of the tolerance table);
scale blocks small enough that every GEMM crosses several of them along N and K, with
per-block magnitudes spread over 100x so that a scale read from the wrong block fails."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moelora import MoEShape, random_expert_weights, random_lora_bank
from moelora.backends.triton import BACKEND, forward_plan
from moelora.call import MoECall
from moelora.compare import assert_close
from moelora.errors import InputError
from moelora.quant.formats import QuantConfig, Quantization
from moelora.quant.fp8_experts import quantize_experts
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


def _problem(shape: MoEShape, quant: QuantConfig, tokens: int, slots: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    full = random_expert_weights(shape, generator=g, dtype=torch.float32)
    full = dataclasses.replace(
        full, w13=_spread(full.w13, quant.block, g), w2=_spread(full.w2, quant.block, g)
    )
    fp8 = quantize_experts(full, quant)
    lora = random_lora_bank(shape, 2, 16, ranks=[16, 8], generator=g)
    x = torch.randn(tokens, shape.hidden_size, generator=g).to(shape.dtype)
    wts, ids = torch.randn(tokens, shape.num_experts, generator=g).softmax(-1).topk(shape.top_k)
    token_slots = torch.tensor(slots, dtype=torch.int32)
    return MoECall(x, ids.int(), wts.float(), token_slots, lora), fp8


def _shape(act: str, dtype: torch.dtype, h: int = 96, i: int = 80, bias: bool = False):
    return MoEShape(4, 2, h, i, act, has_bias=bias, dtype=dtype)


B32 = QuantConfig(Quantization.FP8_BLOCK, (32, 32))
# (id, shape, format, slots per token) - which edge each covers
CASES = [
    ("silu_fp32_lora", _shape("silu", torch.float32), B32, [0, 1, -1, 0, 1]),
    ("silu_bf16_lora", _shape("silu", torch.bfloat16), B32, [1, -1, 0, 0, 1]),
    ("swigluoai_bias", _shape("swigluoai", torch.float32, bias=True), B32, [0, -1, 1]),
    # interleaved gate / up rows read their own scale rows; biases in the epilogue
    ("relu2_nongated", _shape("relu2_no_mul", torch.float16), B32, [0, 1, -1, 1]),
    ("partial_blocks", _shape("silu", torch.float32, h=72, i=40), B32, [0, -1, 1, 0, 0, 1]),
    # H, I not multiples of the block: the last scale blocks are partial
    ("block_128_x_64", _shape("silu", torch.float32, h=160, i=128),
     QuantConfig(Quantization.FP8_BLOCK, (128, 64)), [0, 1, -1]),  # BLOCK_K fitted to 64
    ("base_only", _shape("silu", torch.float32), B32, [-1, -1, -1]),
]  # fmt: skip


@pytest.mark.parametrize("name,shape,quant,slots", CASES, ids=[c[0] for c in CASES])
def test_triton_fp8_block_matches_dequantized_reference(name, shape, quant, slots, seed) -> None:
    call, fp8 = _problem(shape, quant, len(slots), slots, seed)
    out = BACKEND.forward(call, fp8, shape)
    ref = reference_forward(call, fp8.dequantize(), shape)
    # fp32 inputs run exact dots: the fp32 row proves the scale indexing; others the FP8 row
    tol = 1e-5 if shape.dtype == torch.float32 else None
    assert_close(out, ref, FP8, tol=tol, what=name)


def test_fp8_plan_has_no_tma_and_steps_inside_a_block(seed) -> None:
    shape = _shape("silu", torch.bfloat16)
    call, fp8 = _problem(shape, B32, 1, [0], seed)
    tiles = GemmTiles(block_n=64, block_k=128)
    cfg = TileConfig(16, tiles, tiles, decode=True, up_tma=True, down_tma=True)
    plan = forward_plan(call.x, call.topk_ids, fp8, call.lora, shape, config=cfg)
    assert plan.decode and not plan.up.tma and not plan.down.tma
    assert plan.up.tiles.block_k == 32 and plan.down.tiles.block_k == 32


DECODE = TileConfig(16, GemmTiles(16, 32), GemmTiles(16, 32), decode=True)
# (id, shape, slots, early loads) - the decode GEMVs on FP8 rows
DECODE_CASES = [
    ("silu_lora", _shape("silu", torch.float32), [0, -1, 1], False),
    ("silu_early", _shape("silu", torch.float32), [1, 0], True),  # the first step loaded early
    ("swigluoai_bias", _shape("swigluoai", torch.float32, bias=True), [0, -1], False),
    ("relu2_partial", _shape("relu2_no_mul", torch.float32, h=72, i=40), [-1, 1, 0], True),
]  # fmt: skip


@pytest.mark.parametrize("name,shape,slots,early", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_path_on_fp8_rows(name, shape, slots, early, seed) -> None:
    from moelora.backends.triton import fused_moe_lora

    call, fp8 = _problem(shape, B32, len(slots), slots, seed)
    cfg = dataclasses.replace(DECODE, pdl=early)
    out = fused_moe_lora(call, fp8, shape, config=cfg)
    ref = reference_forward(call, fp8.dequantize(), shape)
    assert_close(out, ref, FP8, tol=1e-5, what=name)


def test_triton_refuses_per_channel_fp8(seed) -> None:
    shape = _shape("silu", torch.float32)
    call, _ = _problem(shape, B32, 2, [0, 1], seed)
    g = torch.Generator().manual_seed(seed)
    channel = quantize_experts(
        random_expert_weights(shape, generator=g, dtype=torch.float32),
        QuantConfig(Quantization.FP8_CHANNEL),
    )
    with pytest.raises(InputError) as err:
        BACKEND.forward(call, channel, shape)
    assert "fp8_channel" in str(err.value)


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


def test_layer_runs_fp8_experts_and_base_rows_ignore_loaded_adapters(seed) -> None:
    """vLLM #42008: base rows must not move when adapters are loaded. The same bank shape
    and tile rank, empty (rank 0) or loaded: slot -1 rows bit-identical."""
    shape = _shape("silu", torch.float32)
    call, fp8 = _problem(shape, B32, 6, [0, -1, 1, -1, 0, -1], seed)
    layer = _layer(shape, B32)(fp8)
    loaded = layer.forward(call.x, call.topk_ids, call.topk_weights, call.token_slots, call.lora)
    empty = dataclasses.replace(
        call.lora, ranks=torch.zeros(2, dtype=torch.int32), tile_rank=call.lora.tile_rank
    )
    unloaded = layer.forward(call.x, call.topk_ids, call.topk_weights, call.token_slots, empty)
    base = call.token_slots < 0
    assert torch.equal(loaded[base], unloaded[base])
    ref = reference_forward(call, fp8.dequantize(), shape)
    assert_close(loaded, ref, FP8, tol=1e-5, what="layer")
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
