"""Tensor parallel, expert parallel and fully sharded LoRA over gloo (2 or 4 CPU processes):
every layout equals the single-process reference (fp32), including rank < R, biases
(added once), non-gated and interleaved activations, and both add_inputs modes. The
`triton` cases run the fused kernels interpreted (TRITON_INTERPRET=1) on each rank, with
the fully sharded collectives between their shrink and expand launches."""

from __future__ import annotations

import random

import pytest
import torch
import torch.multiprocessing as mp
from parallel_worker import Case, main

from moelora import (
    Activation,
    AddInputs,
    MoEShape,
    ParallelConfig,
    RoutingConfig,
    RoutingMethod,
    random_expert_weights,
)
from moelora.parallel import RankLayout, local_topk_ids, shard_experts

SWIGLU = dict(
    activation=Activation.SWIGLUOAI, bias=True, routing=RoutingConfig(RoutingMethod.TOPK_SOFTMAX)
)
TRITON = dict(backend="triton")
LLAMA4 = dict(routing=RoutingConfig(RoutingMethod.LLAMA4), top_k=1)
# (case) — the id says which edge it covers.
WORLD2 = [
    Case("tp2-silu", tp=2),
    Case("tp2-swigluoai-bias", tp=2, **SWIGLU),  # interleaved rows split in pairs; b2 once
    Case("tp2-relu2", tp=2, activation=Activation.RELU2_NO_MUL),  # non-gated
    Case("tp2-gelu-add-inputs", tp=2, activation=Activation.GELU, add_inputs=AddInputs.ADD),
    Case("tp2-llama4-weight-on-input", tp=2, **LLAMA4),
    Case("tp2-no-lora", tp=2, lora=False),
    Case("ep2-silu", ep=2),  # tokens routed to the other rank's experts add zero here
    Case("ep2-swigluoai-bias", ep=2, **SWIGLU),
    Case("fs-tp2-silu", tp=2, fully_sharded=True),  # A split on R, all-gather; B2 on H
    Case("fs-tp2-swigluoai-bias", tp=2, fully_sharded=True, **SWIGLU),
    Case("fs-tp2-relu2", tp=2, fully_sharded=True, activation=Activation.RELU2_NO_MUL),
    Case("fs-tp2-add-inputs", tp=2, fully_sharded=True, add_inputs=AddInputs.ADD),
    # triton, fully sharded: gather of [P, S, R/tp] per part, reduce of the down partial,
    # B2 rows at this rank's H offset; adapter ranks 8/4/2 below R = 8 (zero-padded).
    Case("triton-fs-tp2-silu", tp=2, fully_sharded=True, **TRITON),
    Case("triton-fs-tp2-swigluoai-bias", tp=2, fully_sharded=True, **SWIGLU, **TRITON),
    Case(
        "triton-fs-tp2-relu2",
        tp=2,
        fully_sharded=True,
        activation=Activation.RELU2_NO_MUL,  # non-gated: S = 1
        **TRITON,
    ),
    Case("triton-fs-tp2-add-inputs", tp=2, fully_sharded=True, add_inputs=AddInputs.ADD, **TRITON),
    Case(
        "triton-fs-tp2-down-tma",  # z in the sorted order, TMA tiles, under fully sharded
        tp=2,
        fully_sharded=True,
        tiles=(("z_sorted", True), ("down_tma", True)),
        **TRITON,
    ),
    Case("triton-tp2-silu", tp=2, **TRITON),  # plain TP on triton: no collective inside
    # the decode path under fully sharded LoRA (gather of the x shrink, all-reduce of the z
    # shrink the up kernel added up, B2 at this rank's H offset) and under expert parallel
    # the expand over the shrink tiles: used under expert parallel, ignored (the in-GEMM
    # expand) under fully sharded LoRA, equal to the reference either way
    Case("triton-ep2-lora-delta", ep=2, tiles=(("lora_delta", True),), **TRITON),
    Case(
        "triton-ep2-shrink-expand",
        ep=2,
        tiles=(("lora_delta", True), ("shrink_expand", True)),
        **TRITON,
    ),
    # the delta knobs under fully sharded LoRA: ignored (the in-GEMM expand runs)
    Case(
        "triton-fs-tp2-all-delta-knobs",
        tp=2,
        fully_sharded=True,
        tiles=(("lora_delta", True), ("delta_in_reduce", True), ("shrink_expand", True)),
        **TRITON,
    ),
    Case(
        "triton-fs-tp2-all-delta-knobs-relu2",
        tp=2,
        fully_sharded=True,
        activation=Activation.RELU2_NO_MUL,
        tiles=(("lora_delta", True), ("delta_in_reduce", True), ("shrink_expand", True)),
        **TRITON,
    ),
    Case(
        "triton-ep2-delta-in-reduce-add-inputs",
        ep=2,
        add_inputs=AddInputs.ADD,
        tiles=(("lora_delta", True), ("delta_in_reduce", True)),
        **TRITON,
    ),
    Case("triton-tp2-decode", tp=2, tiles=(("decode", True),), **TRITON),  # plain TP, LoRA
    Case(
        "triton-fs-tp2-decode-relu2",  # non-gated (S = 1) under fully sharded LoRA
        tp=2,
        fully_sharded=True,
        activation=Activation.RELU2_NO_MUL,
        tiles=(("decode", True),),
        **TRITON,
    ),
    Case(
        "triton-fs-tp2-lora-delta",
        tp=2,
        fully_sharded=True,
        tiles=(("lora_delta", True),),
        **TRITON,
    ),
    Case(
        "triton-fs-tp2-decode-swigluoai-bias",
        tp=2,
        fully_sharded=True,
        tiles=(("decode", True),),
        **SWIGLU,
        **TRITON,
    ),
    Case(
        "triton-ep2-decode-add-inputs",
        ep=2,
        add_inputs=AddInputs.ADD,
        tiles=(("decode", True),),
        **TRITON,
    ),
]
WORLD4 = [
    Case("tp2-ep2-silu", tp=2, ep=2),
    Case("tp2-ep2-fully-sharded", tp=2, ep=2, fully_sharded=True),
    Case("tp4-fully-sharded-relu2", tp=4, fully_sharded=True, activation=Activation.RELU2_NO_MUL),
]


def _spawn(world: int, cases: list[Case], tmp_path) -> dict[str, tuple[float, float]]:
    result = tmp_path / f"result{world}.pt"
    seed = random.randrange(2**30)  # fresh inputs every run
    mp.spawn(
        main,
        args=(world, str(tmp_path / f"init{world}"), cases, seed, str(result)),
        nprocs=world,
        join=True,
    )
    return {cid: (err, tol) for cid, err, tol in torch.load(result)}


@pytest.mark.parametrize("world,cases", [(2, WORLD2), (4, WORLD4)], ids=["world2", "world4"])
def test_parallel_layouts_equal_single_process(world, cases, tmp_path):
    results = _spawn(world, cases, tmp_path)
    assert set(results) == {c.id for c in cases}
    bad = {cid: err for cid, (err, tol) in results.items() if not err <= tol}
    assert not bad, f"parallel result differs from the single-process reference: {bad}"


def test_sharding_helpers_split_as_documented():
    shape = MoEShape(8, 2, 16, 12, Activation.SWIGLUOAI, has_bias=True, dtype=torch.float32)
    experts = random_expert_weights(shape)
    layout = RankLayout.of(ParallelConfig(tp=2, ep=2), world_rank=3)  # tp_rank 1, ep_rank 1
    assert (layout.tp_rank, layout.ep_rank) == (1, 1)
    local = shard_experts(experts, shape, layout)
    assert local.w13.shape == (4, 12, 16) and local.w2.shape == (4, 16, 6)
    # interleaved gate/up rows: rank 1 holds intermediate units 6..11, i.e. rows 12..23
    assert torch.equal(local.w13, experts.w13[4:, 12:24])
    assert torch.equal(local.b2, torch.zeros_like(local.b2))  # bias added by tp_rank 0 only
    ids = torch.tensor([[0, 5], [7, 3]], dtype=torch.int32)
    assert local_topk_ids(ids, 8, layout).tolist() == [[-1, 1], [3, -1]]
