"""The down GEMM and the z-side LoRA in one launch (`fused_down_lora`,
kernels/down_lora_fused.py) under TRITON_INTERPRET=1: the layer against the fp32 reference
and against the same layer with the knob off, over bank layouts, T with partial blocks,
slot -1 rows and both grid regimes (LoRA tiles outnumbering the GEMM's programs, and the
GEMM's programs running on past the interleaved ones); and where the plan lets it act.

Workspaces are NaN-poisoned (conftest): a program kind that never ran leaves its rows NaN
(o for the GEMM, the delta for the LoRA tiles), and NaN never passes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import pytest
import torch

from moelora.activations import Activation
from moelora.backends.triton import fused_moe_lora
from moelora.call import MoECall
from moelora.compare import REL_TOL, assert_close, compare, poison_
from moelora.config import MoEShape
from moelora.errors import InputError
from moelora.kernels import down_lora_fused as fused_mod
from moelora.kernels import moe_lora
from moelora.reference import moe_lora_reference
from moelora.tiling.config import GemmTiles, TileConfig
from moelora.tiling.plan import LoRAPath, plan_forward
from moelora.weights import random_expert_weights, random_lora_bank

# one 16-row block, N / K tiles of 32: H = 64 gives the GEMM 2 N tiles per block
TILES = TileConfig(16, GemmTiles(32, 32), GemmTiles(32, 32), shrink_block_k=32)
IN_REDUCE = dict(lora_delta=True, delta_in_reduce=True, shrink_expand=True)
STREAM = dict(lora_stream=True, shrink_expand=True)  # the down side alone on the delta path


class Case(NamedTuple):
    id: str
    ranks: tuple[int, ...]  # the bank: one rank per slot
    slots: tuple[int, ...]  # token t on slots[t % len] (-1: no adapter)
    tokens: int
    knobs: dict
    dtype: torch.dtype = torch.float32
    hidden: int = 64
    experts: int = 4


CASES = [
    # 8 x 16, T = 21: 42 pairs, blocks end part-way; slot -1 rows among them
    Case("8x16-partial-blocks", (16,) * 8, (0, 3, -1, 7, 5), 21, IN_REDUCE),
    Case("8x16-bf16", (16,) * 8, (0, 3, -1, 7, 5), 21, IN_REDUCE, torch.bfloat16),
    # 64 x 16, 4 slots used: most slots empty; more LoRA tiles than GEMM programs (idle
    # interleaved GEMM slots at the end of the grid)
    Case("64x16-empty-slots", (16,) * 64, (0, 63, -1, 17, 40), 30, IN_REDUCE, hidden=32),
    Case("64x16-bf16", (16,) * 64, (0, 63, -1, 17, 40), 30, IN_REDUCE, torch.bfloat16),
    # mixed ranks in one bank (rank < R, a rank not a power of two)
    Case("mixed-ranks", (16, 8, 64, 5), (2, 0, 1, -1, 3), 13, IN_REDUCE),
    Case("mixed-ranks-bf16", (16, 8, 64, 5), (2, 0, 1, -1, 3), 13, IN_REDUCE, torch.bfloat16),
    # few tiles, H = 128: 4 N tiles a block, the GEMM's programs run on past the interleave
    Case("gemm-tail", (16, 16), (0, 1, 1, 0), 6, IN_REDUCE, hidden=128, experts=2),
    # z in the sorted order (the shrink reads z's sorted rows), and by TMA tiles
    Case("z-sorted", (16,) * 8, (0, 3, -1, 7, 5), 21, dict(IN_REDUCE, z_sorted=True)),
    Case("down-tma", (16, 8, 64, 5), (2, 0, 1, -1), 13, dict(IN_REDUCE, down_tma=True)),
    # the down side alone on the delta path (lora_stream): the gate/up side expands in-GEMM
    Case("stream-down-side", (16, 8, 64, 5), (2, 0, 1, -1, 3), 13, STREAM),
]


def _layer(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = MoEShape(case.experts, 2, case.hidden, 32, Activation.SILU, dtype=case.dtype)
    experts = random_expert_weights(shape, generator=g)
    lora = random_lora_bank(shape, len(case.ranks), max(case.ranks), ranks=list(case.ranks),
                            generator=g)  # fmt: skip
    x = torch.randn(case.tokens, case.hidden, generator=g).to(case.dtype)
    weights, ids = torch.topk(torch.randn(case.tokens, case.experts, generator=g).softmax(-1), 2)
    slots = torch.tensor([case.slots[t % len(case.slots)] for t in range(case.tokens)],
                         dtype=torch.int32)  # fmt: skip
    return shape, experts, lora, x, ids.to(torch.int32), weights, slots


def _tolerance(dtype: torch.dtype) -> float:
    """The dtype's row of the one tolerance table."""
    return REL_TOL[dtype]


def _forward(case: Case, layer, fused: bool) -> torch.Tensor:
    shape, experts, lora, x, ids, weights, slots = layer
    cfg = dataclasses.replace(TILES, **case.knobs, fused_down_lora=fused)
    out = poison_(torch.empty_like(x))
    fused_moe_lora(MoECall(x, ids, weights, slots, lora, out=out), experts, shape, config=cfg)
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fused_layer_matches_the_reference_and_the_unfused_layer(case: Case, seed: int) -> None:
    layer = _layer(case, seed)
    shape, experts, lora, x, ids, weights, slots = layer
    ref = moe_lora_reference(x, ids, weights, slots, experts, lora, shape)
    out = _forward(case, layer, fused=True)
    assert_close(out, ref, tol=_tolerance(case.dtype), what=f"{case.id} fused vs reference")
    unfused = _forward(case, layer, fused=False)
    assert compare(out, unfused, case.dtype).ok, compare(out, unfused, case.dtype)
    # the z-side LoRA really is in it: without the down delta the adapter rows move
    no_down = dataclasses.replace(lora, w2_b=torch.zeros_like(lora.w2_b))
    base = moe_lora_reference(x, ids, weights, slots, experts, no_down, shape)
    assert not compare(out[slots >= 0], base[slots >= 0], case.dtype).ok


@pytest.mark.parametrize("every", [3, 5])
def test_other_interleaves_match_the_reference(every: int, monkeypatch, seed: int) -> None:
    """LORA_EVERY is the launch's constexpr: one LoRA program in 3 or 5 at the start."""
    case = CASES[4]  # mixed ranks, slot -1
    monkeypatch.setattr(
        moe_lora, "down_lora_fused", functools.partial(fused_mod.down_lora_fused, lora_every=every)
    )
    layer = _layer(case, seed)
    shape, experts, lora, x, ids, weights, slots = layer
    ref = moe_lora_reference(x, ids, weights, slots, experts, lora, shape)
    assert_close(_forward(case, layer, fused=True), ref, tol=_tolerance(case.dtype),
                 what=f"lora_every={every}")  # fmt: skip


def test_an_interleave_below_2_is_refused(monkeypatch, seed: int) -> None:
    every_1 = functools.partial(fused_mod.down_lora_fused, lora_every=1)
    monkeypatch.setattr(moe_lora, "down_lora_fused", every_1)
    with pytest.raises(InputError, match="lora_every"):
        _forward(CASES[0], _layer(CASES[0], seed), fused=True)


class _Counted:
    """A kernel that records its name at each launch, then launches."""

    def __init__(self, kernel, names: list):
        self.kernel, self.names = kernel, names

    def __getitem__(self, grid):
        self.names.append(self.kernel.__name__)
        return self.kernel[grid]


def _kernels_launched(monkeypatch, fused: bool) -> list[str]:
    """The LoRA shrink / down kernels one forward of the 8 x 16 case launches."""
    from moelora.kernels import expert_down, lora_shrink

    names: list[str] = []
    for module, name in ((lora_shrink, "_lora_shrink_kernel"),
                         (expert_down, "_expert_down_kernel"),
                         (fused_mod, "_down_lora_fused_kernel")):  # fmt: skip
        monkeypatch.setattr(module, name, _Counted(getattr(module, name), names))
    _forward(CASES[0], _layer(CASES[0], 0), fused=fused)
    monkeypatch.undo()
    return names


def test_the_knob_replaces_the_down_gemm_and_the_z_shrink_with_one_launch(monkeypatch) -> None:
    off = _kernels_launched(monkeypatch, fused=False)
    on = _kernels_launched(monkeypatch, fused=True)
    # off: the x and z shrinks, the down GEMM; on: the x shrink, then the fused launch
    assert off == ["_lora_shrink_kernel", "_lora_shrink_kernel", "_expert_down_kernel"]
    assert on == ["_lora_shrink_kernel", "_down_lora_fused_kernel"]


# (id, knobs, plan_forward call changes, fused expected) — where the knob acts
PLAN_CASES = [
    ("delta-in-reduce-shrink-expand", IN_REDUCE, {}, True),
    ("stream-shrink-expand", STREAM, {}, True),
    ("interpreted", IN_REDUCE, dict(interpreted=True), True),  # the CPU runs it too
    ("no-shrink-expand", dict(lora_delta=True, delta_in_reduce=True), {}, False),
    ("down-delta-in-gemm", dict(lora_delta=True, shrink_expand=True), {}, False),
    ("stream-without-shrink-expand", dict(lora_stream=True), {}, False),
    ("in-gemm-expand", {}, {}, False),
    ("atomic-reduce", dict(IN_REDUCE, atomic_reduce=True), {}, False),
    ("fully-sharded", IN_REDUCE, dict(sharded=True), False),
    ("lora-free", IN_REDUCE, dict(lora=False), False),
    ("decode", dict(IN_REDUCE, decode=True), {}, False),
]


@pytest.mark.parametrize("knobs,call,want", [c[1:] for c in PLAN_CASES],
                         ids=[c[0] for c in PLAN_CASES])  # fmt: skip
def test_where_the_plan_fuses(knobs: dict, call: dict, want: bool) -> None:
    cfg = dataclasses.replace(TILES, **knobs, fused_down_lora=True)
    kw = dict(dict(lora=True, sharded=False, pdl_supported=False, interpreted=False), **call)
    plan = plan_forward(cfg, **kw)
    assert plan.fused_down_lora is want
    if want:  # the down side is the reduce's delta; no side stream beside one launch
        assert plan.down_lora is LoRAPath.DELTA and not plan.down_gemm_lora
        assert not plan.lora_stream
    off = plan_forward(dataclasses.replace(cfg, fused_down_lora=False), **kw)
    assert not off.fused_down_lora
    # the knob changes nothing else in the plan
    assert dataclasses.replace(plan, fused_down_lora=False, lora_stream=off.lora_stream,
                               tiles=off.tiles) == off  # fmt: skip
