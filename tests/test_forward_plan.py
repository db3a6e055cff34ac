"""The plan of a forward (tiling/plan.py): every decision the pipeline reads, as a case
table over the knobs and the call (LoRA or not, fully sharded, a GPU with PDL, the
interpreter), and the backend's use of it (which config is fitted, what the kernels see)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moelora.tiling.align_launch import AlignMode
from moelora.tiling.config import GemmTiles, TileConfig
from moelora.tiling.plan import ForwardPlan, LoRAPath, TopKSum, plan_forward

BASE = TileConfig(32, GemmTiles(64, 64, 4, 3), GemmTiles(128, 64, 8, 2), group_m=4)
CALL = dict(lora=True, sharded=False, pdl_supported=False, interpreted=False)

# (id, knobs, call changes, expected plan fields) — what each case pins down in a comment
CASES = [
    # the default LoRA path: each GEMM expands, o reduced by topk_reduce, nothing sorted
    ("default", {}, {}, dict(lora=LoRAPath.EXPAND, top_k_sum=TopKSum.REDUCE, z_sorted=False)),
    # no bank or no slots: LoRA-free whatever the LoRA knobs say
    (
        "lora-free",
        {"lora_delta": True},
        dict(lora=False),
        dict(lora=LoRAPath.NONE, down_gemm_lora=False),
    ),
    (
        "delta",
        {"lora_delta": True},
        {},
        dict(
            lora=LoRAPath.DELTA, delta_by_shrink=False, delta_in_reduce=False, down_gemm_lora=True
        ),
    ),
    # the delta knobs act only with lora_delta
    (
        "delta-knobs-alone",
        {"delta_in_reduce": True, "shrink_expand": True},
        {},
        dict(lora=LoRAPath.EXPAND, delta_by_shrink=False, delta_in_reduce=False),
    ),
    (
        "delta-by-shrink",
        {"lora_delta": True, "shrink_expand": True},
        {},
        dict(delta_by_shrink=True),
    ),
    # the reduce adds the down delta: the down GEMM runs LoRA-free
    (
        "delta-in-reduce",
        {"lora_delta": True, "delta_in_reduce": True},
        {},
        dict(delta_in_reduce=True, down_gemm_lora=False),
    ),
    # lora_stream: the down side on the DELTA path into the reduce, the gate/up side as set
    (
        "lora-stream",
        {"lora_stream": True, "atomic_reduce": True},
        {},
        dict(
            lora=LoRAPath.EXPAND,
            down_lora=LoRAPath.DELTA,
            delta_in_reduce=True,
            down_gemm_lora=False,
            lora_stream=True,
            top_k_sum=TopKSum.REDUCE,
        ),
    ),
    (
        "lora-stream-delta",
        {"lora_stream": True, "lora_delta": True},
        {},
        dict(lora=LoRAPath.DELTA, down_lora=LoRAPath.DELTA, lora_stream=True),
    ),
    # the interpreter runs the same kernels in order: no streams, same paths
    (
        "lora-stream-interpreted",
        {"lora_stream": True},
        dict(interpreted=True),
        dict(down_lora=LoRAPath.DELTA, delta_in_reduce=True, lora_stream=False),
    ),
    # not under fully sharded LoRA (its all-reduce sits in the branch), not without LoRA
    (
        "lora-stream-sharded",
        {"lora_stream": True},
        dict(sharded=True),
        dict(down_lora=LoRAPath.EXPAND, delta_in_reduce=False, lora_stream=False),
    ),
    (
        "lora-stream-lora-free",
        {"lora_stream": True},
        dict(lora=False),
        dict(down_lora=LoRAPath.NONE, lora_stream=False, down_gemm_lora=False),
    ),
    (
        "lora-stream-decode",
        {"lora_stream": True, "decode": True},
        {},
        dict(lora=LoRAPath.EXPAND, down_lora=LoRAPath.EXPAND, lora_stream=False),
    ),
    # fully sharded: collectives sit between shrink and expand, so no lora_delta
    (
        "sharded-delta",
        {"lora_delta": True, "shrink_expand": True},
        dict(sharded=True),
        dict(lora=LoRAPath.EXPAND, delta_by_shrink=False),
    ),
    ("atomic", {"atomic_reduce": True}, {}, dict(top_k_sum=TopKSum.ATOMIC)),
    (
        "atomic-lora-free",
        {"atomic_reduce": True},
        dict(lora=False),
        dict(top_k_sum=TopKSum.ATOMIC),
    ),
    # the reduce pass adds the delta rows: no atomic sum with delta_in_reduce
    (
        "atomic-delta-in-reduce",
        {"atomic_reduce": True, "lora_delta": True, "delta_in_reduce": True},
        {},
        dict(top_k_sum=TopKSum.REDUCE),
    ),
    (
        "atomic-delta",
        {"atomic_reduce": True, "lora_delta": True},
        {},
        dict(top_k_sum=TopKSum.ATOMIC),
    ),
    # down_tma implies z_sorted (its TMA tiles of z need the sorted rows)
    ("down-tma", {"down_tma": True}, {}, dict(z_sorted=True)),
    ("z-sorted", {"z_sorted": True}, {}, dict(z_sorted=True)),
    # PDL: asked, on a GPU that has it, not interpreted, not sharded
    ("pdl", {"pdl": True}, dict(pdl_supported=True), dict(pdl=True, early_loads=True)),
    ("pdl-unsupported", {"pdl": True}, {}, dict(pdl=False, early_loads=False)),
    ("pdl-not-asked", {}, dict(pdl_supported=True), dict(pdl=False, early_loads=False)),
    ("pdl-sharded", {"pdl": True}, dict(pdl_supported=True, sharded=True), dict(pdl=False)),
    # the interpreter runs the early loads (CPU coverage), never PDL itself
    (
        "pdl-interpreted",
        {"pdl": True},
        dict(pdl_supported=True, interpreted=True),
        dict(pdl=False, early_loads=True),
    ),
    ("decode", {"decode": True, "lora_delta": True}, {}, dict(decode=True, lora=LoRAPath.EXPAND)),
]


@pytest.mark.parametrize("knobs,call,want", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_plan_decisions(knobs: dict, call: dict, want: dict) -> None:
    plan = plan_forward(dataclasses.replace(BASE, **knobs), **{**CALL, **call})
    got = {k: getattr(plan, k) for k in want}
    assert got == want


@pytest.mark.parametrize(
    "half_tail,up,down", [(0, False, False), (1, True, False), (2, False, True), (3, True, True)]
)
def test_each_gemm_gets_its_tiles_and_knobs(half_tail: int, up: bool, down: bool) -> None:
    """half_tail bit 1 is the up GEMM's, bit 2 the down GEMM's; each GEMM its own tiles and
    TMA knob, both the shared knobs and the z layout."""
    cfg = dataclasses.replace(BASE, half_tail=half_tail, up_tma=True, expand_first=True)
    plan = plan_forward(cfg, **CALL)
    assert (plan.up.half_tail, plan.down.half_tail) == (up, down)
    assert (plan.up.tiles, plan.down.tiles) == (cfg.up, cfg.down)
    assert (plan.up.tma, plan.down.tma) == (True, False)
    for gemm in (plan.up, plan.down):
        assert (gemm.group_m, gemm.expand_lanes, gemm.expand_first) == (4, 32, True)
        assert gemm.z_sorted == plan.z_sorted


def test_the_plan_is_frozen_and_computed_once() -> None:
    plan = plan_forward(BASE, **CALL)
    assert isinstance(plan, ForwardPlan) and plan.tiles == BASE
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.pdl = True
    assert plan_forward(BASE, **CALL) is plan  # cached: a forward's Python cost stays flat


def test_the_backend_plans_what_it_picked_and_fitted() -> None:
    """forward_plan: the picked config for the call's shape (on cpu unchanged by the fit),
    LoRA only with a bank, fully sharded from the call; an explicit config as given."""
    from moelora.activations import Activation
    from moelora.backends.triton import forward_plan
    from moelora.config import MoEShape
    from moelora.tiling.pick import pick_config
    from moelora.weights import random_expert_weights, random_lora_bank

    shape = MoEShape(4, 2, 32, 16, Activation.SILU, dtype=torch.float32)
    experts = random_expert_weights(shape)
    bank = random_lora_bank(shape, 2, 4)
    x, ids = torch.zeros(5, 32), torch.zeros(5, 2, dtype=torch.int32)
    plan = forward_plan(x, ids, experts, bank, shape, sharded=True)
    assert plan.tiles == pick_config(5, 4, 2, 32, 16, lora=True)
    assert plan.lora is LoRAPath.EXPAND and not plan.pdl
    assert forward_plan(x, ids, experts, None, shape).lora is LoRAPath.NONE
    assert forward_plan(x, ids, experts, None, shape, config=BASE).tiles == BASE


# (P pairs, E experts, the launch it takes, why)
ALIGN_LAUNCHES = [
    (2, 32, AlignMode.ONE_PAIR, 256, "P <= E/4: one pair per block"),
    (9, 32, AlignMode.SINGLE, 1024, "just above E/4: the sort, in one program"),
    (1024, 128, AlignMode.SINGLE, 1024, "P = WIDE_SINGLE_PAIRS: the narrow program"),
    (1025, 128, AlignMode.SINGLE, 2048, "above it: the wide program"),
    (2048, 128, AlignMode.SINGLE, 2048, "P = SINGLE_PROGRAM_PAIRS: still one program"),
    (2049, 128, AlignMode.THREE, 256, "above it: three launches"),
]


@pytest.mark.parametrize("pairs,experts,mode,block_p,why", ALIGN_LAUNCHES)
def test_the_plan_picks_the_alignment_launch(pairs, experts, mode, block_p, why) -> None:
    launch = plan_forward(BASE, **CALL).align(pairs, experts)
    assert (launch.mode, launch.block_p) == (mode, block_p), why
