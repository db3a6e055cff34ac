"""One MoE + multi-LoRA expert layer from the launchers, as its plan says (tiling/plan.py).

Aligned path: align (+ LoRA shrink tiles) -> (shrink of x) -> up GEMM with LoRA and
activation -> (shrink of z) -> down GEMM with weighted LoRA -> top-k sum. Decode path
(a few tokens): (shrink of x) -> up GEMV with LoRA, activation and the z shrink -> down
GEMV with weighted LoRA and the top-k sum: no alignment, 2-3 launches. docs/kernels.md
describes each step.

No host synchronisation and static shapes per T, so the whole call is CUDA-graph capturable
(its workspaces come from the graph's private pool). Composition only: every choice is the
plan's.

Fully sharded LoRA (a `lora_comm` given): the banks are this process's shards (gate/up A on the
rank, down A on I, down B on H). Two collectives per forward, on every process in the same
order whatever the routing: the gate/up shrink result [P, S, R/tp] is all-gathered to
[P, S, R], and the down shrink's partial sum over this process's I shard [P, R] is all-reduced;
the down expand then writes its H/tp slice of columns. Both stay fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..call import MoECall
from ..comm import LoRAComm
from ..config import MoEShape
from ..quant.fp8_experts import FP8ExpertWeights
from ..tiling.geometry import expand_rank_block
from ..tiling.plan import ForwardPlan, LoRAPath, TopKSum
from ..weights import ExpertWeights, LoRABank
from .align import AlignedPairs, align_pairs
from .atomic_reduce import finish_sum, sum_buffer
from .decode_down import decode_down
from .decode_shrink import decode_shrink
from .decode_up import decode_up
from .expert_down import expert_down
from .expert_up import expert_up
from .lora_delta import lora_delta
from .lora_shrink import lora_shrink
from .quant_rows import quant_rows
from .side_stream import side_stream
from .topk_reduce import topk_reduce


@dataclass(frozen=True)
class _Layer:
    """One call's record with what the pipeline adds: the slots and bank only when the
    plan runs LoRA (None otherwise), and the weights."""

    call: MoECall
    slots: torch.Tensor | None
    lora: LoRABank | None
    experts: ExpertWeights | FP8ExpertWeights
    shape: MoEShape

    @property
    def out(self) -> torch.Tensor | None:
        return self.call.out

    @property
    def add(self) -> bool:
        return self.call.adds

    @property
    def num_pairs(self) -> int:
        return self.call.topk_ids.numel()

    @property
    def comm(self) -> LoRAComm | None:
        return self.call.lora_comm

    def up_args(self) -> dict:
        """What both up kernels (expert_up, decode_up) take from the layer alike: the
        activation with its constants, the routing weights where they scale the input
        (else None), the token slots."""
        return {
            "activation": self.shape.activation,
            "alpha": self.shape.swiglu_alpha,
            "limit": self.shape.swiglu_limit,
            "topk_weights": self.call.topk_weights if self.call.weights_on_input else None,
            "token_slots": self.slots,
        }

    def quantized(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A base GEMM input t [M, K] as FP8 experts read it (W8A8): e4m3 values and fp32
        scales per row and activation group, quantized once here (quant_rows.py); None for
        serving-dtype experts."""
        if not isinstance(self.experts, FP8ExpertWeights):
            return None
        return quant_rows(t, self.experts.quant.activation_group)

    def scales(self, name: str) -> dict:
        """The GEMM launcher's FP8 arguments for weight `name` ("w13" / "w2"): its scales
        and the format's block, or nothing for serving-dtype experts."""
        if not isinstance(self.experts, FP8ExpertWeights):
            return {}
        return {
            "w_scale": getattr(self.experts, f"{name}_scale"),
            "scale_block": self.experts.quant.block,
        }


def forward(
    plan: ForwardPlan, call: MoECall, experts: ExpertWeights | FP8ExpertWeights, shape: MoEShape
) -> torch.Tensor:
    """y [T, H] in x's dtype (written into call.out if given, added with ADD).

    call: the checked per-call record (call.py: x [T, H], topk_ids [T, K], topk_weights
    [T, K] fp32, token_slots [T] int32, the bank; contiguous); experts w13 [E, S*I, H], w2
    [E, H, I], in x's dtype or (FP8ExpertWeights) e4m3 with block or per-channel scales,
    run W8A8 (docs/fp8.md), the LoRA branch reading the unquantized rows. The bank is used only when the plan's LoRA path is not NONE; call.lora_comm:
    fully sharded LoRA's collectives (the bank then holds w13_a [L, E, S, R/tp, H] and
    w2_b [L, E, H/tp, R]).
    """
    if call.num_tokens == 0:  # nothing routed: the op form's output is empty (or left as is)
        return call.out if call.out is not None else call.x.new_empty(0, call.x.shape[1])
    use_lora = plan.lora is not LoRAPath.NONE
    layer = _Layer(
        call=call,
        slots=call.token_slots if use_lora else None,
        lora=call.lora if use_lora else None,
        experts=experts,
        shape=shape,
    )
    return _decode(plan, layer) if plan.decode else _aligned(plan, layer)


def _aligned(plan: ForwardPlan, c: _Layer) -> torch.Tensor:
    """align -> (shrink x) -> up GEMM -> (shrink z) -> down GEMM -> top-k sum."""
    lora, experts = c.lora, c.experts
    num_experts, top_k = experts.w13.shape[0], c.call.topk_ids.shape[1]
    aligned = align_pairs(
        c.call.topk_ids,
        c.slots,
        num_experts,
        lora.num_slots if lora is not None else 0,
        plan.tiles.block_m,
        plan.tiles.shrink_block_m if lora is not None else 0,
        pdl=plan.pdl,
        launch=plan.align(c.num_pairs, num_experts),
    )
    inter13 = delta13 = None
    if lora is not None:
        gather = None if c.comm is None else lambda t: _gather_parts(t, c.comm)
        inter13, delta13 = _lora_side(
            plan,
            c,
            c.call.x,
            lora.w13_a,
            lora.w13_b,
            aligned,
            "tokens",
            gather,
            _rank_offset(c),
            plan.lora,
        )
    z = expert_up(
        c.call.x,
        experts.w13,
        experts.b13,
        aligned,
        plan.up,
        top_k=top_k,
        **c.up_args(),
        inter=inter13,
        lora_b=lora.w13_b if lora is not None else None,
        delta=delta13,
        lora_ranks=lora.ranks if lora is not None else None,
        tile_rank=lora.tile_rank if lora is not None else None,
        pdl=plan.pdl,
        x_quant=c.quantized(c.call.x),
        **c.scales("w13"),
    )
    if lora is None:
        return _down_and_sum(plan, c, z, aligned, None, None)
    reduce = None if c.comm is None else lambda t: c.comm.reduce_rank(t.view(t.shape[0], -1))
    rows = "sorted" if plan.z_sorted else "pairs"

    def down_side():
        return _lora_side(
            plan, c, z, lora.w2_a, lora.w2_b, aligned, rows, reduce, 0, plan.down_lora
        )

    if plan.lora_stream:
        with side_stream(z.device) as branch:
            branch.run(down_side)  # z shrink + delta expand, beside the LoRA-free down GEMM
            return _down_and_sum(plan, c, z, aligned, *branch.result, before_sum=branch.join)
    return _down_and_sum(plan, c, z, aligned, *down_side())


def _down_and_sum(
    plan: ForwardPlan,
    c: _Layer,
    z: torch.Tensor,
    aligned: AlignedPairs,
    inter2: torch.Tensor | None,
    delta2: torch.Tensor | None,
    before_sum=None,
) -> torch.Tensor:
    """The down GEMM (with its LoRA term unless the reduce adds it), then the top-k sum:
    the GEMM's own atomic sum, or the reduce over o (adding the down delta with
    delta_in_reduce). before_sum: called between the two (lora_stream: the join, after
    which delta2 is ready)."""
    num_tokens, hidden = c.call.x.shape
    acc = direct = None
    if plan.top_k_sum is TopKSum.ATOMIC:
        acc, direct = sum_buffer(
            num_tokens, hidden, c.call.x.dtype, out=c.out, add=c.add, device=c.call.x.device
        )
    o = _down_gemm(plan, c, z, aligned, inter2, delta2, acc)
    num_experts = c.experts.w13.shape[0]
    if before_sum is not None:
        before_sum()
    if plan.top_k_sum is TopKSum.ATOMIC:
        return (
            acc if direct else finish_sum(acc, c.call.x.dtype, out=c.out, add=c.add, pdl=plan.pdl)
        )
    if not plan.delta_in_reduce:
        return topk_reduce(o, c.call.topk_ids, num_experts, out=c.out, add=c.add, pdl=plan.pdl)
    return topk_reduce(
        o,
        c.call.topk_ids,
        num_experts,
        out=c.out,
        add=c.add,
        delta=delta2.view(c.num_pairs, -1),
        token_slots=c.slots,
        num_slots=c.lora.num_slots,
        topk_weights=None if c.call.weights_on_input else c.call.topk_weights,
        pdl=plan.pdl,
    )


def _down_gemm(
    plan: ForwardPlan,
    c: _Layer,
    z: torch.Tensor,
    aligned: AlignedPairs,
    inter2: torch.Tensor | None,
    delta2: torch.Tensor | None,
    acc: torch.Tensor | None,
) -> torch.Tensor:
    """The down GEMM alone: with its LoRA term unless the reduce adds it, summing into acc
    with the atomic top-k sum. -> o [P, H] (acc with the atomic sum)."""
    lora = c.lora if plan.down_gemm_lora else None
    return expert_down(
        z,
        c.experts.w2,
        c.experts.b2,
        aligned,
        plan.down,
        top_k=c.call.topk_ids.shape[1],
        topk_weights=None if c.call.weights_on_input else c.call.topk_weights,
        token_slots=c.slots if lora is not None else None,
        inter=inter2 if lora is not None else None,
        lora_b=lora.w2_b if lora is not None else None,
        lora_n_offset=c.comm.hidden_offset if c.comm is not None else 0,
        num_pairs=c.num_pairs,
        delta=delta2 if lora is not None else None,
        lora_ranks=lora.ranks if lora is not None else None,
        tile_rank=lora.tile_rank if lora is not None else None,
        sum_into=acc,
        pdl=plan.pdl,
        **c.scales("w2"),
        z_quant=c.quantized(z),
    )


def _lora_side(
    plan: ForwardPlan,
    c: _Layer,
    inp: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    aligned: AlignedPairs,
    rows: str,
    collect,
    rank_offset: int,
    path: LoRAPath,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One LoRA side (gate/up from x, or down from z) on its path (EXPAND or DELTA): the
    shrink, then `collect` (fully sharded LoRA's collective on the intermediate, or None),
    then on the DELTA path the expand over the shrink tiles (inside the shrink with
    delta_by_shrink). rank_offset: lora_a's first rank column (fully sharded LoRA's gate/up
    A is a rank shard). -> (inter, delta)."""
    kw = dict(
        num_pairs=c.num_pairs,
        rows=rows,
        top_k=c.call.topk_ids.shape[1],
        block_k=plan.tiles.shrink_block_k,
        split_k=plan.tiles.shrink_split_k,
        tile_rank=c.lora.tile_rank,
        pdl=plan.pdl,
    )
    ranks = c.lora.ranks
    # the in-GEMM expand's passes read every slot's intermediate up to one block of columns
    # past the widest slot: the shrink writes zeros that far (the delta expands read less)
    fill = 0 if path is LoRAPath.DELTA else expand_rank_block(c.lora.tile_rank)
    if plan.delta_by_shrink and path is LoRAPath.DELTA:
        # no collective between shrink and expand: the plan takes DELTA only unsharded
        assert collect is None, "shrink_expand needs whole intermediates"
        return None, lora_shrink(
            inp, lora_a, aligned, expand_b=lora_b, ranks=ranks, one_dot=plan.expand_one_dot, **kw
        )
    inter = lora_shrink(
        inp, lora_a, aligned, ranks=ranks, rank_offset=rank_offset, fill_block=fill, **kw
    )
    if collect is not None:
        inter = collect(inter)
    if path is not LoRAPath.DELTA:
        return inter, None
    return inter, lora_delta(
        inter,
        lora_b,
        aligned,
        dtype=inp.dtype,
        ranks=ranks,
        pdl=plan.pdl,
        one_dot=plan.expand_one_dot,
    )


def _decode(plan: ForwardPlan, c: _Layer) -> torch.Tensor:
    """(shrink x and zero the z shrink) -> up GEMV (+ z shrink) -> down GEMV with the sum."""
    lora, experts = c.lora, c.experts
    inter13 = z_inter = None
    if lora is not None:
        rows_per_prog, block_k = plan.tiles.decode_shrink
        inter13, z_inter = decode_shrink(
            c.call.x,
            lora.w13_a,
            c.call.topk_ids,
            c.slots,
            experts.w13.shape[0],
            lora.w2_a.shape[2],
            rows_per_prog=rows_per_prog,
            block_k=block_k,
            ranks=lora.ranks,
            rank_offset=_rank_offset(c),
            pdl=plan.pdl,
        )
        if c.comm is not None:
            inter13 = _gather_parts(inter13, c.comm)
    z = decode_up(
        c.call.x,
        experts.w13,
        experts.b13,
        c.call.topk_ids,
        **c.up_args(),
        inter=inter13,
        lora_b=lora.w13_b if lora is not None else None,
        lora_a2=lora.w2_a if lora is not None else None,
        z_inter=z_inter,
        lora_ranks=lora.ranks if lora is not None else None,
        tiles=plan.tiles.up,
        pdl=plan.pdl,
        chained=lora is not None,  # after decode_shrink; else the layer's first kernel
        early=plan.early_loads,
        **c.scales("w13"),
        x_quant=c.quantized(c.call.x),
    )
    if c.comm is not None and z_inter is not None:
        z_inter = c.comm.reduce_rank(z_inter)
    return decode_down(
        z,
        experts.w2,
        experts.b2,
        c.call.topk_ids,
        topk_weights=None if c.call.weights_on_input else c.call.topk_weights,
        token_slots=c.slots,
        z_inter=z_inter,
        lora_b=lora.w2_b if lora is not None else None,
        lora_n_offset=c.comm.hidden_offset if c.comm is not None else 0,
        lora_ranks=lora.ranks if lora is not None else None,
        tiles=plan.tiles.down,
        out=c.out,
        add=c.add,
        pdl=plan.pdl,
        chained=True,
        early=plan.early_loads,
        **c.scales("w2"),
        z_quant=c.quantized(z),
    )


def _rank_offset(c: _Layer) -> int:
    """The first rank column of this process's gate/up A: 0, or under fully sharded LoRA
    its TP rank's shard start (tp_rank = the down B's H slice index)."""
    if c.comm is None:
        return 0
    return c.comm.hidden_offset // c.lora.w2_b.shape[2] * c.lora.w13_a.shape[3]


def _gather_parts(inter: torch.Tensor, comm: LoRAComm) -> torch.Tensor:
    """[P, S, R/tp] -> [P, S, R]: one all-gather over the rank for every part at once.

    gather_rank concatenates the last dim in rank order, so the parts go to the rows:
    [S*P, R/tp] in, [S*P, R] out, returned as an [P, S, R] strided view (the up kernel
    takes strides)."""
    pairs, parts, rank_shard = inter.shape
    rows = inter.transpose(0, 1).reshape(parts * pairs, rank_shard)
    full = comm.gather_rank(rows)
    return full.view(parts, pairs, full.shape[1]).transpose(0, 1)
