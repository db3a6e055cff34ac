"""One MoE + multi-LoRA expert layer from the launchers: align (+ LoRA shrink tiles) ->
(shrink) -> up GEMM with LoRA and activation -> (shrink of z) -> down GEMM with weighted
LoRA -> top-k reduce. With lora_delta, each shrink is followed by its expand over the
shrink tiles, and the GEMMs add those delta rows instead of expanding. With a decode
config (a few tokens): (shrink of x) -> up GEMV with LoRA, activation and the z shrink ->
down GEMV with weighted LoRA and the top-k sum: no alignment, 2-3 launches.

No host synchronisation and static shapes per T, so the whole call is CUDA-graph capturable
(its workspaces come from the graph's private pool). Composition only: no policy here
beyond using the caller's tile config.

Fully sharded LoRA (a `lora_comm` given): the banks are this rank's shards (gate/up A on the
rank, down A on I, down B on H). Two collectives per forward, on every rank in the same
order whatever the routing: the gate/up shrink result [P, S, R/tp] is all-gathered to
[P, S, R], and the down shrink's partial sum over this rank's I shard [P, R] is all-reduced;
the down expand then writes its H/tp slice of columns. Both stay fp32.
"""

from __future__ import annotations

import torch

from ..config import MoEShape
from ..reference import LoRAComm
from ..weights import ExpertWeights, LoRABank
from .align import align_pairs
from .atomic_reduce import finish_sum, sum_buffer
from .checks import interpreted
from .configs import TileConfig, pick_config
from .decode_down import decode_down
from .decode_shrink import decode_shrink
from .decode_up import decode_up
from .device_fit import fit_to_device
from .expert_down import expert_down
from .expert_up import expert_up
from .lora_delta import lora_delta
from .lora_shrink import lora_shrink
from .pdl import pdl_active
from .topk_reduce import topk_reduce


def fused_moe_lora(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    token_slots: torch.Tensor | None,
    experts: ExpertWeights,
    lora: LoRABank | None,
    shape: MoEShape,
    *,
    weights_on_input: bool = False,
    out: torch.Tensor | None = None,
    add: bool = False,
    config: TileConfig | None = None,
    lora_comm: LoRAComm | None = None,
) -> torch.Tensor:
    """y [T, H] in x's dtype (written into `out` if given; add=True adds to it).

    x [T, H]; topk_ids [T, K] int32; topk_weights [T, K] fp32; token_slots [T] int32 or None;
    experts w13 [E, S*I, H], w2 [E, H, I]; lora: LoRABank or None (base only); lora_comm:
    fully sharded LoRA's collectives (lora then holds w13_a [L, E, S, R/tp, H] and
    w2_b [L, E, H/tp, R]).
    """
    num_tokens, hidden = x.shape
    if num_tokens == 0:  # nothing routed: the op form's output is empty (or left as is)
        return out if out is not None else x.new_empty(0, hidden)
    top_k = topk_ids.shape[1]
    num_experts = experts.w13.shape[0]
    inter_size = experts.w2.shape[2]
    use_lora = lora is not None and token_slots is not None
    # a picked config is fitted to the device (shared memory, TMA); an explicit one is not.
    # The rank is B's: under fully sharded LoRA the expand still runs at the full R.
    cfg = config or fit_to_device(
        pick_config(num_tokens, num_experts, top_k, hidden, inter_size, use_lora),
        shape.activation.width_factor,
        x.dtype,
        x.device,
        rank=lora.w13_b.shape[-1] if use_lora and lora.num_slots else 0,
        num_slots=lora.num_slots if use_lora else 0,
    )
    num_slots = lora.num_slots if use_lora else 0
    x = x.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()
    slots = token_slots.to(torch.int32).contiguous() if use_lora else None
    # PDL between the layer's kernels: not with collectives between them (pdl.py)
    pdl = lora_comm is None and pdl_active(cfg.pdl, x.device)
    if cfg.decode:
        return _decode_forward(
            x,
            topk_ids,
            topk_weights,
            slots,
            experts,
            lora if use_lora else None,
            shape,
            cfg,
            weights_on_input=weights_on_input,
            out=out,
            add=add,
            lora_comm=lora_comm,
            pdl=pdl,
        )
    z_sorted = cfg.z_sorted or cfg.down_tma  # the TMA tiles of z need the sorted rows
    aligned = align_pairs(
        topk_ids,
        slots,
        num_experts,
        num_slots,
        cfg.block_m,
        cfg.shrink_block_m if use_lora else 0,
        pdl=pdl,
    )
    num_pairs = num_tokens * top_k

    inter13 = inter2 = delta13 = delta2 = None
    # the expand over the shrink tiles needs whole intermediates and whole-H B2: not under
    # fully sharded LoRA (its collectives sit between shrink and expand)
    use_delta = use_lora and cfg.lora_delta and lora_comm is None
    side = dict(
        aligned=aligned, cfg=cfg, num_pairs=num_pairs, top_k=top_k, delta=use_delta, pdl=pdl
    )
    if use_lora:
        gather = None if lora_comm is None else lambda t: _gather_parts(t, lora_comm)
        inter13, delta13 = _lora_side(
            x, lora.w13_a, lora.w13_b, rows="tokens", collect=gather, **side
        )
    z = expert_up(
        x,
        experts.w13,
        experts.b13,
        aligned,
        activation=shape.activation,
        top_k=top_k,
        alpha=shape.swiglu_alpha,
        limit=shape.swiglu_limit,
        topk_weights=topk_weights if weights_on_input else None,
        token_slots=slots,
        inter=inter13,
        lora_b=lora.w13_b if use_lora else None,
        block_n=cfg.up.block_n,
        block_k=cfg.up.block_k,
        group_m=cfg.group_m,
        num_warps=cfg.up.num_warps,
        num_stages=cfg.up.num_stages,
        expand_lanes=cfg.expand_lanes,
        z_sorted=z_sorted,
        expand_first=cfg.expand_first,
        half_tail=bool(cfg.half_tail & 1),
        tma=cfg.up_tma,
        delta=delta13,
        pdl=pdl,
    )
    if use_lora:
        reduce = (
            None if lora_comm is None else lambda t: lora_comm.reduce_rank(t.view(t.shape[0], -1))
        )
        inter2, delta2 = _lora_side(
            z, lora.w2_a, lora.w2_b, rows="sorted" if z_sorted else "pairs", collect=reduce, **side
        )
    # with delta_in_reduce the down GEMM runs LoRA-free and the reduce adds the delta
    down_lora = use_lora and not (use_delta and cfg.delta_in_reduce)
    # atomic_reduce: the down GEMM sums the pairs into [T, H] fp32 itself (not with
    # delta_in_reduce, whose reduce pass adds the delta rows)
    atomic = cfg.atomic_reduce and (down_lora or delta2 is None)
    if atomic:
        acc, direct = sum_buffer(num_tokens, hidden, x.dtype, out=out, add=add, device=x.device)
    o = expert_down(
        z,
        experts.w2,
        experts.b2,
        aligned,
        top_k=top_k,
        topk_weights=None if weights_on_input else topk_weights,
        token_slots=slots if down_lora else None,
        inter=inter2 if down_lora else None,
        lora_b=lora.w2_b if down_lora else None,
        block_n=cfg.down.block_n,
        block_k=cfg.down.block_k,
        group_m=cfg.group_m,
        num_warps=cfg.down.num_warps,
        num_stages=cfg.down.num_stages,
        lora_n_offset=lora_comm.hidden_offset if lora_comm is not None else 0,
        expand_lanes=cfg.expand_lanes,
        z_sorted=z_sorted,
        num_pairs=num_pairs,
        tma=cfg.down_tma,
        expand_first=cfg.expand_first,
        half_tail=bool(cfg.half_tail & 2),
        delta=delta2 if down_lora else None,
        sum_into=acc if atomic else None,
        pdl=pdl,
    )
    if atomic:
        return acc if direct else finish_sum(acc, x.dtype, out=out, add=add, pdl=pdl)
    if down_lora or delta2 is None:
        return topk_reduce(o, topk_ids, num_experts, out=out, add=add, pdl=pdl)
    return topk_reduce(
        o,
        topk_ids,
        num_experts,
        out=out,
        add=add,
        delta=delta2.view(num_pairs, -1),
        token_slots=slots,
        num_slots=num_slots,
        topk_weights=None if weights_on_input else topk_weights,
        pdl=pdl,
    )


def _lora_side(
    inp: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    *,
    aligned,
    cfg: TileConfig,
    rows: str,
    num_pairs: int,
    top_k: int,
    delta: bool,
    collect,
    pdl: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One LoRA side (gate/up from x, or down from z): the shrink, then `collect` (fully
    sharded LoRA's collective on the intermediate, or None), then with `delta` the expand
    over the shrink tiles, inside the shrink when cfg.shrink_expand. -> (inter, delta)."""
    kw = dict(
        num_pairs=num_pairs,
        rows=rows,
        top_k=top_k,
        block_k=cfg.shrink_block_k,
        split_k=cfg.shrink_split_k,
        pdl=pdl,
    )
    if delta and cfg.shrink_expand:
        # no collective between shrink and expand: only without fully sharded LoRA
        assert collect is None, "shrink_expand needs whole intermediates"
        return None, lora_shrink(inp, lora_a, aligned, expand_b=lora_b, **kw)
    inter = lora_shrink(inp, lora_a, aligned, **kw)
    if collect is not None:
        inter = collect(inter)
    if not delta:
        return inter, None
    return inter, lora_delta(inter, lora_b, aligned, dtype=inp.dtype, pdl=pdl)


def _decode_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    slots: torch.Tensor | None,
    experts: ExpertWeights,
    lora: LoRABank | None,
    shape: MoEShape,
    cfg: TileConfig,
    *,
    weights_on_input: bool,
    out: torch.Tensor | None,
    add: bool,
    lora_comm: LoRAComm | None,
    pdl: bool,
) -> torch.Tensor:
    """The decode path (fused_moe_lora's arguments, slots int32 or None without LoRA;
    pdl: PDL launches, as fused_moe_lora decided)."""
    # the peeled first weight step only pays with PDL (alone it measured +12% at T = 8);
    # the interpreter runs it so that the CPU tests cover it
    early = cfg.pdl and (pdl or interpreted())
    inter13 = z_inter = None
    if lora is not None:
        rows_per_prog, block_k = cfg.decode_shrink
        inter13, z_inter = decode_shrink(
            x,
            lora.w13_a,
            topk_ids,
            slots,
            experts.w13.shape[0],
            lora.w2_a.shape[2],
            rows_per_prog=rows_per_prog,
            block_k=block_k,
            pdl=pdl,
        )
        if lora_comm is not None:
            inter13 = _gather_parts(inter13, lora_comm)
    z = decode_up(
        x,
        experts.w13,
        experts.b13,
        topk_ids,
        activation=shape.activation,
        alpha=shape.swiglu_alpha,
        limit=shape.swiglu_limit,
        topk_weights=topk_weights if weights_on_input else None,
        token_slots=slots,
        inter=inter13,
        lora_b=lora.w13_b if lora is not None else None,
        lora_a2=lora.w2_a if lora is not None else None,
        z_inter=z_inter,
        block_n=cfg.up.block_n,
        block_k=cfg.up.block_k,
        num_warps=cfg.up.num_warps,
        num_stages=cfg.up.num_stages,
        pdl=pdl,
        chained=lora is not None,  # after decode_shrink; else the layer's first kernel
        early=early,
    )
    if lora_comm is not None and z_inter is not None:
        z_inter = lora_comm.reduce_rank(z_inter)
    return decode_down(
        z,
        experts.w2,
        experts.b2,
        topk_ids,
        topk_weights=None if weights_on_input else topk_weights,
        token_slots=slots,
        z_inter=z_inter,
        lora_b=lora.w2_b if lora is not None else None,
        lora_n_offset=lora_comm.hidden_offset if lora_comm is not None else 0,
        block_n=cfg.down.block_n,
        block_k=cfg.down.block_k,
        num_warps=cfg.down.num_warps,
        num_stages=cfg.down.num_stages,
        out=out,
        add=add,
        pdl=pdl,
        chained=True,
        early=early,
    )


def _gather_parts(inter: torch.Tensor, comm: LoRAComm) -> torch.Tensor:
    """[P, S, R/tp] -> [P, S, R]: one all-gather over the rank for every part at once.

    gather_rank concatenates the last dim in rank order, so the parts go to the rows:
    [S*P, R/tp] in, [S*P, R] out, returned as an [P, S, R] strided view (the up kernel
    takes strides)."""
    pairs, parts, rank_shard = inter.shape
    rows = inter.transpose(0, 1).reshape(parts * pairs, rank_shard)
    full = comm.gather_rank(rows)
    return full.view(parts, pairs, full.shape[1]).transpose(0, 1)
