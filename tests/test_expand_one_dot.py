"""`expand_one_dot` (TileConfig knob; tiles.expand_dot's ONE_DOT) under TRITON_INTERPRET=1:
on 16-bit inputs every LoRA expand multiplies B by the rank intermediate rounded to x's
dtype (one dot) instead of its hi + lo parts (two dots, ~16 mantissa bits), as HF + PEFT
compute lora_B(lora_A(x)) in bf16. On each expand path (the in-GEMM expand, after or
before the K loop; the delta kernel; the shrink_expand, its down delta added by the GEMM or
by the top-k reduce) the layer
with the knob on is checked against the fp32 reference within its dtype's tolerance, and
against a reference whose LoRA branch is held in bf16 (`lora_held`) to show the knob
really rounds; fp32 inputs ignore it, and the plan passes it only where an expand runs.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch

from moelora.activations import Activation
from moelora.backends.triton import fused_moe_lora
from moelora.call import MoECall
from moelora.compare import REL_TOL, assert_close, poison_
from moelora.config import MoEShape
from moelora.reference import moe_lora_reference
from moelora.tiling.config import GemmTiles, TileConfig
from moelora.tiling.plan import plan_forward
from moelora.weights import LoRABank, random_expert_weights, random_lora_bank

# one 16-row block, N / K tiles of 32: H = 64 gives each GEMM 2 K steps / N tiles
TILES = TileConfig(16, GemmTiles(32, 32), GemmTiles(32, 32), shrink_block_k=32)
# the expand paths, each with the knobs that select it
PATHS = {
    "in-gemm": {},  # both GEMMs expand after their K loop
    "in-gemm-expand-first": dict(expand_first=True),  # ... as a pipelined loop before it
    "lora-delta": dict(lora_delta=True),  # the delta kernel over the shrink tiles
    "shrink-expand": dict(lora_delta=True, shrink_expand=True),  # the shrink expands
    # ... the down side's delta added by the top-k reduce (the down GEMM LoRA-free)
    "in-reduce": dict(lora_delta=True, delta_in_reduce=True, shrink_expand=True),
}


class Case(NamedTuple):
    id: str
    path: str  # a PATHS key
    dtype: torch.dtype
    ranks: tuple[int, ...] = (16, 16, 16)  # the bank: one rank per slot
    slots: tuple[int, ...] = (0, 1, -1, 2)  # token t on slots[t % len] (-1: no adapter)
    act: Activation = Activation.SILU
    tokens: int = 13


def _layer(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = MoEShape(4, 2, 64, 32, case.act, dtype=case.dtype)
    experts = random_expert_weights(shape, generator=g)
    lora = random_lora_bank(shape, len(case.ranks), max(case.ranks), ranks=list(case.ranks),
                            generator=g)  # fmt: skip
    x = torch.randn(case.tokens, 64, generator=g).to(case.dtype)
    weights, ids = torch.topk(torch.randn(case.tokens, 4, generator=g).softmax(-1), 2)
    slots = torch.tensor([case.slots[t % len(case.slots)] for t in range(case.tokens)],
                         dtype=torch.int32)  # fmt: skip
    return shape, experts, lora, x, ids.to(torch.int32), weights, slots


def _forward(layer, path: str, one_dot: bool) -> torch.Tensor:
    shape, experts, lora, x, ids, weights, slots = layer
    cfg = dataclasses.replace(TILES, **PATHS[path], expand_one_dot=one_dot)
    out = poison_(torch.empty_like(x))
    fused_moe_lora(MoECall(x, ids, weights, slots, lora, out=out), experts, shape, config=cfg)
    return out


def _reference(layer, held: torch.dtype | None = None) -> torch.Tensor:
    shape, experts, lora, x, ids, weights, slots = layer
    return moe_lora_reference(x, ids, weights, slots, experts, lora, shape, lora_held=held)


BF16, FP16 = torch.bfloat16, torch.float16
CASES = [
    *[Case(f"{path}-bf16", path, BF16) for path in PATHS],
    # mixed real ranks (rank < R, not a multiple of 16) and a slot -1 row on both paths
    Case("in-gemm-mixed-ranks-bf16", "in-gemm", BF16, ranks=(16, 5, 32), slots=(2, 0, -1, 1)),
    Case("shrink-expand-mixed-ranks-bf16", "shrink-expand", BF16, ranks=(16, 5, 32)),
    # fp16: the native 16-bit dot in the interpreter (no upcast); interleaved gate / up rows
    Case("in-gemm-fp16", "in-gemm", FP16),
    Case("lora-delta-swigluoai-fp16", "lora-delta", FP16, act=Activation.SWIGLUOAI),
    Case("in-reduce-fp16", "in-reduce", FP16),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_one_dot_layer_matches_the_reference(case: Case, seed: int) -> None:
    layer = _layer(case, seed)
    out = _forward(layer, case.path, one_dot=True)
    assert_close(out, _reference(layer), tol=REL_TOL[case.dtype], what=case.id)


def _cancelling(a: torch.Tensor, b: torch.Tensor, scale: float):
    """A [..., R, in] and B [..., out, R] (fp32) whose rank columns cancel in pairs: A's odd
    rows are the even ones plus 1% of a random row, B's odd columns the negated even ones,
    so the delta is ~1% of each term: rounding the intermediate to bf16 (2^-9 relative)
    moves the delta by several percent, the hi / lo split (~2^-17) by nothing visible.
    B times `scale`: the delta a good part of y."""
    a, b = a.clone(), b.clone()
    a[..., 1::2, :] = a[..., 0::2, :] + 0.01 * a[..., 1::2, :]
    b[..., 1::2] = -b[..., 0::2]
    return a, b * scale


def _cancelling_bank(lora: LoRABank, side: str, dtype: torch.dtype) -> LoRABank:
    """lora with `side`'s factors cancelling (up: w13, down: w2) and the other
    side's B / 4096, so that its own roundings stay below the fp32 noise: the down side's
    intermediate is then the same z @ A2 in the kernel and in the reference, not moved
    across a bf16 rounding by the up delta's (the delta paths store it in bf16)."""
    a13, b13, a2, b2 = (t.float() for t in (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b))
    if side == "up":
        (a13, b13), b2 = _cancelling(a13, b13, 24.0), b2 / 4096
    else:
        (a2, b2), b13 = _cancelling(a2, b2, 24.0), b13 / 4096
    factors = (t.to(dtype) for t in (a13, b13, a2, b2))
    return LoRABank(*factors, ranks=lora.ranks, tile_rank=lora.tile_rank)


# (path, side, dtype): the side whose expand is shown to round; in-reduce's up side is
# shrink-expand's. bf16 runs the interpreter's upcast branch, fp16 the native dot GPUs run.
ROUNDING = [
    (p, s, d)
    for p in PATHS
    for s in ("up", "down")
    for d in (BF16, FP16)
    if (p, s) != ("in-reduce", "up")
]
# a 16-bit output step (relative): what the held and the exact references must differ by
STEP = {BF16: 2**-8, FP16: 2**-11}


def _closer_to_held(out: torch.Tensor, held: torch.Tensor, exact: torch.Tensor, step: float):
    """(n, share): n output elements at which the held and the exact references are at
    least 4 output steps (`step` relative each) apart, and the share of those at which `out`
    is closer to the held one. Per element, so that a rare row whose z rounds the other
    way in the kernel than in the reference (its intermediate then rounds differently
    there too) moves the share by that row alone."""
    out, held, exact = (t.double() for t in (out, held, exact))
    tells = (held - exact).abs() > 4 * step * exact.abs()
    closer = (out - held).abs() < (out - exact).abs()
    return int(tells.sum()), closer[tells].double().mean().item()


@pytest.mark.parametrize(
    "path,side,dtype", ROUNDING, ids=[f"{p}-{s}-{str(d)[6:]}" for p, s, d in ROUNDING]
)
def test_one_dot_rounds_the_intermediate(path: str, side: str, dtype, seed: int) -> None:
    """With `side`'s factors cancelling (_cancelling), the reference holding the LoRA branch
    in `dtype` and the exact one are several output steps apart at many elements (checked: the case can
    tell them apart). At most of those the knob on must be closer to the held reference
    and the knob off to the exact one: an ignored knob gives the same output on and off
    (the two shares cannot both hold), a knob applied to the other side only leaves this
    side exact, and a wrong rounding (e.g. truncating) misses the held reference; each
    fails. The off output is also within tolerance of the exact reference and the on one
    finite (NaN is closer to nothing). Every token has an adapter."""
    case = Case(f"{path}-{side}", path, dtype, slots=(0, 1, 2))
    shape, experts, lora, x, ids, weights, slots = _layer(case, seed)
    layer = (shape, experts, _cancelling_bank(lora, side, dtype), x, ids, weights, slots)
    exact, held = _reference(layer), _reference(layer, held=dtype)
    on, off = _forward(layer, path, one_dot=True), _forward(layer, path, one_dot=False)
    assert_close(off, exact, tol=REL_TOL[dtype], what=f"{case.id} off")
    assert torch.isfinite(on).all()
    n, on_share = _closer_to_held(on, held, exact, STEP[dtype])
    _, off_share = _closer_to_held(off, held, exact, STEP[dtype])
    assert n >= 100, f"the references tell apart only {n} elements"
    assert on_share > 0.8 and off_share < 0.2, f"{n} elements: on {on_share}, off {off_share}"


@pytest.mark.parametrize("path", ["in-gemm", "shrink-expand", "in-reduce"])
def test_fp32_inputs_ignore_the_knob(path: str, seed: int) -> None:
    """fp32 serving: exact fp32 dots with the knob on too (nothing rounds the intermediate)."""
    layer = _layer(Case(path, path, torch.float32), seed)
    on = _forward(layer, path, one_dot=True)
    assert torch.equal(on, _forward(layer, path, one_dot=False))
    assert_close(on, _reference(layer), tol=REL_TOL[torch.float32], what=path)


# (id, knobs, plan_forward call changes, whether the plan passes the knob on)
PLAN_CASES = [
    ("in-gemm-expand", {}, {}, True),
    ("delta", dict(lora_delta=True), {}, True),
    ("fully-sharded", {}, dict(sharded=True), True),  # the in-GEMM expand after the gather
    ("lora-free", {}, dict(lora=False), False),  # no expand at all
    ("decode", dict(decode=True), {}, False),  # the GEMVs expand in fp32 registers
]


@pytest.mark.parametrize("knobs,call,want", [c[1:] for c in PLAN_CASES],
                         ids=[c[0] for c in PLAN_CASES])  # fmt: skip
def test_where_the_plan_passes_the_knob(knobs: dict, call: dict, want: bool) -> None:
    cfg = dataclasses.replace(TILES, **knobs, expand_one_dot=True)
    kw = dict(dict(lora=True, sharded=False, pdl_supported=False, interpreted=True), **call)
    plan = plan_forward(cfg, **kw)
    assert plan.expand_one_dot is plan.up.expand_one_dot is plan.down.expand_one_dot is want
    off = plan_forward(dataclasses.replace(cfg, expand_one_dot=False), **kw)
    assert not off.expand_one_dot
    # the knob changes nothing else in the plan
    one = dict(expand_one_dot=False)
    assert dataclasses.replace(plan, **one, tiles=off.tiles, up=off.up, down=off.down) == off
    assert dataclasses.replace(plan.up, **one) == off.up
    assert dataclasses.replace(plan.down, **one) == off.down
