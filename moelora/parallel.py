"""Tensor parallel, expert parallel and fully sharded LoRA over torch.distributed (NCCL on
GPUs, gloo on CPUs). The only module that calls torch.distributed.

Processes: world = tp * ep, world_rank = ep_rank * tp + tp_rank. Every rank holds the same x and
routing; each computes its share and one all-reduce over the world finishes the layer.
- TP: w13 split on its I rows (gate and up halves, or interleaved pairs, stay aligned),
  w2 on its I columns, b2 added by tp_rank 0 only. LoRA: gate/up A replicated, gate/up B
  split on I, down A split on I, down B replicated. No extra collective.
- Fully sharded LoRA (tp > 1): gate/up A split on the rank (R / tp), down B split on H; the
  shrink results are all-gathered / all-reduced over the TP group (LoRAComm). Banks are
  zero-padded to R before sharding (the slot bank layout already is).
- EP: experts split in contiguous blocks of E_l; ids of other processes' experts become -1 and
  contribute zero here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .activations import Activation
from .call import MoECall
from .config import AddInputs, MoEShape, ParallelConfig
from .deployment import Deployment
from .errors import ConfigError
from .layer import MoELoRALayer
from .layer_checks import resolve_add_inputs
from .weights import ExpertWeights, LoRABank


@dataclass(frozen=True)
class RankLayout:
    """Where one rank sits: tp_rank in its TP group, ep_rank among the expert blocks."""

    tp: int
    ep: int
    tp_rank: int
    ep_rank: int
    fully_sharded: bool = False

    @staticmethod
    def of(parallel: ParallelConfig, world_rank: int) -> RankLayout:
        """The layout of process `world_rank` (its torch.distributed rank) in tp * ep."""
        world = parallel.tp * parallel.ep
        if not 0 <= world_rank < world:
            raise ConfigError("world_rank", world_rank, f"0 <= world_rank < tp * ep = {world}")
        return RankLayout(
            parallel.tp,
            parallel.ep,
            world_rank % parallel.tp,
            world_rank // parallel.tp,
            parallel.fully_sharded_loras,
        )


def _split(t: Tensor, dim: int, parts: int, index: int) -> Tensor:
    size = t.shape[dim] // parts
    return t.narrow(dim, index * size, size).contiguous()


def _w13_rows(t: Tensor, shape: MoEShape, layout: RankLayout) -> Tensor:
    """This process's rows of w13 [E, S*I, ...] / b13 [E, S*I] (dim 1), row layout kept."""
    if not shape.activation.is_gated or shape.activation is Activation.SWIGLUOAI:
        return _split(t, 1, layout.tp, layout.tp_rank)  # [w1] or interleaved gate/up pairs
    gate, up = t.chunk(2, dim=1)
    return torch.cat(
        [_split(gate, 1, layout.tp, layout.tp_rank), _split(up, 1, layout.tp, layout.tp_rank)],
        dim=1,
    )


def shard_experts(experts: ExpertWeights, shape: MoEShape, layout: RankLayout) -> ExpertWeights:
    """This process's expert weights: E_l experts, I_p intermediate units."""

    def local(t: Tensor | None) -> Tensor | None:
        return None if t is None else _split(t, 0, layout.ep, layout.ep_rank)

    w13, w2, b13, b2 = (local(t) for t in (experts.w13, experts.w2, experts.b13, experts.b2))
    w13 = _w13_rows(w13, shape, layout)
    w2 = _split(w2, 2, layout.tp, layout.tp_rank)
    b13 = None if b13 is None else _w13_rows(b13, shape, layout)
    if b2 is not None and layout.tp_rank != 0:
        b2 = torch.zeros_like(b2)  # the partials are summed: add the bias once
    return ExpertWeights(w13, w2, b13, b2)


def shard_bank(bank: LoRABank, layout: RankLayout) -> LoRABank:
    """This process's slot bank (see the module docstring for which factor splits where)."""

    def local(t: Tensor) -> Tensor:
        return _split(t, 1, layout.ep, layout.ep_rank)

    w13_a, w13_b, w2_a, w2_b = (local(t) for t in (bank.w13_a, bank.w13_b, bank.w2_a, bank.w2_b))
    tp, r = layout.tp, layout.tp_rank
    w13_b = _split(w13_b, 3, tp, r)  # [L, E_l, S, I_p, R]
    w2_a = _split(w2_a, 3, tp, r)  # [L, E_l, R, I_p]
    if layout.fully_sharded:
        w13_a = _split(w13_a, 3, tp, r)  # [L, E_l, S, R/tp, H]
        w2_b = _split(w2_b, 2, tp, r)  # [L, E_l, H/tp, R]
    return LoRABank(w13_a, w13_b, w2_a, w2_b, ranks=bank.ranks, tile_rank=bank.tile_rank)


def local_topk_ids(topk_ids: Tensor, num_experts: int, layout: RankLayout) -> Tensor:
    """Global expert ids [T, K] -> this process's local ids; other processes' experts become -1."""
    local_experts = num_experts // layout.ep
    local = topk_ids - layout.ep_rank * local_experts
    return torch.where((local >= 0) & (local < local_experts), local, -1).to(topk_ids.dtype)


class DistComm:
    """LoRAComm (comm.py) over a torch.distributed TP group (fully sharded LoRA)."""

    def __init__(self, layout: RankLayout, hidden_size: int, group) -> None:
        self.tp, self.group = layout.tp, group
        self.hidden_offset = layout.tp_rank * (hidden_size // layout.tp)

    def gather_rank(self, u: Tensor) -> Tensor:
        pieces = [torch.empty_like(u) for _ in range(self.tp)]
        dist.all_gather(pieces, u.contiguous(), group=self.group)
        return torch.cat(pieces, dim=-1)

    def reduce_rank(self, v: Tensor) -> Tensor:
        v = v.contiguous()
        dist.all_reduce(v, group=self.group)
        return v


# (default group, tp, ep) -> this process's TP group. Every layer of a model shares one group
# (communicators are costly to create), and new_group is collective, so it runs once.
_TP_GROUPS: dict[tuple[object, int, int], object] = {}


def _tp_group(layout: RankLayout):
    """The TP group of this process (every process creates every group, in the same order)."""
    key = (dist.group.WORLD, layout.tp, layout.ep)
    if key not in _TP_GROUPS:
        groups = [
            dist.new_group([e * layout.tp + r for r in range(layout.tp)]) for e in range(layout.ep)
        ]
        _TP_GROUPS[key] = groups[layout.ep_rank]
    return _TP_GROUPS[key]


class ParallelMoELoRALayer:
    """One process's share of a MoE-LoRA layer; forward returns the full y on every process.

    Build it on every process of an initialised default process group of size tp * ep, from
    the full (unsharded) weights: each process keeps its shard only. The oracle checks the
    deployment (its parallel layout included) once, at construction. check_values: as
    MoELoRALayer's (False drops its per-forward GPU sync, what a timed or captured loop needs).
    """

    def __init__(
        self, deployment: Deployment, experts: ExpertWeights, *, check_values: bool = True
    ) -> None:
        parallel = deployment.parallel
        world = dist.get_world_size()
        if world != parallel.tp * parallel.ep:
            raise ConfigError(
                "world_size",
                world,
                f"tp * ep = {parallel.tp * parallel.ep}",
                "launch one process per place of the layout",
            )
        self.layout = RankLayout.of(parallel, dist.get_rank())
        self.num_experts = deployment.shape.num_experts
        self.layer = MoELoRALayer(
            deployment,
            shard_experts(experts, deployment.shape, self.layout),
            check_values=check_values,
        )
        self.comm = (
            DistComm(self.layout, deployment.shape.hidden_size, _tp_group(self.layout))
            if self.layout.fully_sharded
            else None
        )

    def shard_bank(self, bank: LoRABank) -> LoRABank:
        """This process's share of a full slot bank (e.g. a SlotManager snapshot's bank)."""
        return shard_bank(bank, self.layout)

    def forward(
        self,
        x: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        token_slots: Tensor | None = None,
        lora: LoRABank | None = None,
        *,
        out: Tensor | None = None,
        add_inputs: AddInputs | None = None,
    ) -> Tensor:
        """Like MoELoRALayer.forward, with global topk_ids and this process's bank shard."""
        ids = local_topk_ids(topk_ids, self.num_experts, self.layout)
        comm = self.comm if lora is not None else None
        weights_on_input = self.layer.deployment.routing.method.weights_on_input
        call = MoECall(x, ids, topk_weights, token_slots, lora, weights_on_input, comm)
        y = self.layer.run(call)
        self.reduce_output(y)
        if out is None:
            return y
        mode = resolve_add_inputs(self.layer.deployment, add_inputs)
        return out.add_(y) if mode is AddInputs.ADD else out.copy_(y)

    def reduce_output(self, y: Tensor) -> None:
        """y [T, H]: this process's partial sum -> the sum over the world, in place. The one
        collective every layout issues (fully sharded LoRA adds `comm`'s two); a method, so
        that scripts/parallel_bench.py can time the layer without it and it alone."""
        dist.all_reduce(y)

    __call__ = forward
