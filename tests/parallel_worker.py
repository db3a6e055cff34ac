"""Worker for tests/test_parallel.py: run in each spawned rank (gloo), every case of
CASES; rank 0 reports (case id, rel_err vs the single-process reference, tolerance)."""

from __future__ import annotations

import dataclasses
import os

import torch

# A spawned rank imports this module fresh (conftest.py does not run there): the `triton`
# cases need the interpreter on CPUs, set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist

from moelora import (
    Activation,
    AddInputs,
    LoRAConfig,
    MoEShape,
    ParallelConfig,
    RoutingConfig,
    RoutingMethod,
    random_expert_weights,
    random_lora_bank,
    route,
)
from moelora.commands.validate.suites.layouts import parallel_vs_reference
from moelora.compare import compare, poison_
from moelora.deployment import Deployment
from moelora.device import target

SOFTMAX = RoutingConfig(RoutingMethod.SOFTMAX_TOPK, renormalize=True)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    tp: int = 1
    ep: int = 1
    fully_sharded: bool = False
    activation: Activation = Activation.SILU
    bias: bool = False
    routing: RoutingConfig = SOFTMAX
    top_k: int = 2
    add_inputs: AddInputs = AddInputs.OVERWRITE
    lora: bool = True
    backend: str = "reference"
    tiles: tuple = ()  # triton: (TileConfig field, value) pairs on top of the chosen config


def _inputs(case: Case, seed: int):
    shape = MoEShape(
        8,
        case.top_k,
        32,
        24,
        case.activation,
        has_bias=case.bias,
        dtype=torch.float32,
        swiglu_limit=2.0,
    )
    gen = torch.Generator().manual_seed(seed)  # the same on every rank
    experts = random_expert_weights(shape, generator=gen)
    bank = random_lora_bank(shape, 3, 8, ranks=[8, 4, 2], generator=gen)  # ranks below R
    x = torch.randn(11, 32, generator=gen)
    ids, wts = route(torch.randn(11, 8, generator=gen), case.routing, case.top_k)
    slots = torch.tensor([-1, 0, 1, 2, 0, -1, 2, 1, 0, 2, -1], dtype=torch.int32)
    return shape, experts, bank, x, ids, wts, slots


def run_case(case: Case, seed: int) -> tuple[float, float]:
    from moelora.backends import triton as moe_lora

    pick = moe_lora.pick_config
    if case.tiles:  # this process only: every triton forward takes these knobs
        knobs = dict(case.tiles)
        moe_lora.pick_config = lambda *a, **k: dataclasses.replace(pick(*a, **k), **knobs)
    try:
        return _run_case(case, seed)
    finally:
        moe_lora.pick_config = pick


def _run_case(case: Case, seed: int) -> tuple[float, float]:
    shape, experts, bank, x, ids, wts, slots = _inputs(case, seed)
    lora_cfg = LoRAConfig(enabled=case.lora, max_rank=8, num_slots=3, add_inputs=case.add_inputs)
    deployment = Deployment(
        shape=shape,
        routing=case.routing,
        device=target("cpu"),
        parallel=ParallelConfig(case.tp, case.ep, case.fully_sharded),
        lora=lora_cfg,
        backend=case.backend,
    )
    prior = torch.randn(11, 32, generator=torch.Generator().manual_seed(seed + 1))
    out = prior.clone() if case.add_inputs is AddInputs.ADD else poison_(torch.empty(11, 32))
    bank_in, slots_in = (bank, slots) if case.lora else (None, None)
    out, ref = parallel_vs_reference(
        deployment, experts, bank_in, x, ids, wts, slots_in, out=out, add_inputs=case.add_inputs
    )
    if case.add_inputs is AddInputs.ADD:
        ref = ref + prior
    result = compare(out, ref, torch.float32)
    return result.rel_err, result.tol


def main(rank: int, world: int, init_file: str, cases: list[Case], seed: int, result_file: str):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        rows = [(case.id, *run_case(case, seed + i)) for i, case in enumerate(cases)]
        if rank == 0:
            torch.save(rows, result_file)
        # every rank done before any tears gloo down: a rank leaving while a peer still
        # talks to it aborted the peer ("terminate called without an active exception",
        # SIGABRT) in about one run in six on a 2-core CI machine
        dist.barrier()
    finally:
        dist.destroy_process_group()
