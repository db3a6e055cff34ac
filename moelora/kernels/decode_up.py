"""Decode-path gate/up GEMV: z[p] = act(x[token(p)] @ w13[e]^T + LoRA expand (+ b13)),
one program per (pair, BLOCK_N units of I), straight from the top-k ids (no alignment).

At a handful of tokens the layer is the weight read: every pair streams its expert's
rows once. The aligned GEMM pads each pair to a 16-row dot and its program count per
expert is fixed by BLOCK_N; here a program holds BLOCK_N units (gate and up rows) and
sums products in fp32 registers, so the grid is P * I / BLOCK_N small programs, many
resident per SM, and the weight read has no wave tail (v9 in docs/history/kernel_log.md).

LoRA: the expand is an fp32 dot of the shrink intermediate with B rows (exact, no 16-bit
split needed off the tensor cores), added before the activation. The z shrink follows in
the epilogue: the program's z units times the matching columns of the down A, added with
fp32 atomics into z_inter [P, R] (zeroed by decode_shrink), so no separate z-shrink launch
and no second read of z. The atomics make the LoRA result's last bits depend on the order
the programs finish (not bitwise repeatable run to run, like the split-K shrink); the
LoRA-free path is deterministic. Pairs routed outside [0, E) are skipped (z rows
unwritten).

Legend: T tokens, K top-k, P = T*K pairs, E experts, H hidden, I intermediate, R rank.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..activations import Activation
from ..tiling.config import GemmTiles
from ..tiling.geometry import gate_up_rows, rows_share_scale_block
from .activation import act_code, apply_act
from .checks import (
    check_dtype_match,
    check_fp8_weight,
    check_shape,
    check_weight_dtype,
    fp8_scale_args,
    quantized_input_args,
    workspace,
)
from .fp8_tiles import block_scaled, scaled_columns
from .launch_args import strides
from .output import as_stored
from .pdl import chain_point
from .ranks import slot_ranks


@triton.jit
def _rows_dot(w_ptrs, xv, mask):
    """[BLOCK_N] fp32: each row of the [BLOCK_N, BLOCK_K] tile at w_ptrs dotted with xv."""
    w = tl.load(w_ptrs, mask=mask, other=0.0)
    return tl.sum(w.to(tl.float32) * xv[None, :], axis=1)


@triton.jit
def _scaled_inputs(
    xv, xs_row, x_quant, sg_row, su_row, stride_sk, cols, k_ok, GATED: tl.constexpr,
    SCALE_COLUMNS: tl.constexpr, SCALE_K: tl.constexpr,
):  # fmt: skip
    """The step's x as the gate rows and the up rows read it: xv itself, or with
    SCALE_COLUMNS each column times its activation-group scale and the rows' weight block
    scale (the gate's at sg_row, the up's at su_row: fp8_tiles.scaled_columns); x_quant
    (launch_args.QuantRows) gives the activation scales' group stride."""
    xg = xv
    xu = xv
    if SCALE_COLUMNS:
        stride_xsg = x_quant.stride_xsg
        xg = scaled_columns(xv, xs_row, stride_xsg, sg_row, stride_sk, cols, k_ok, SCALE_K)
        if GATED:
            xu = scaled_columns(xv, xs_row, stride_xsg, su_row, stride_sk, cols, k_ok, SCALE_K)
    return xg, xu


@triton.jit
def _decode_up_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    z_ptr,
    topk_ids_ptr,
    topk_weights_ptr,
    slots_ptr,
    inter_ptr,
    lora_b_ptr,
    lora_a2_ptr,
    z_inter_ptr,
    top_k,
    num_experts,
    num_slots,
    rank,
    z_rank,
    ranks_ptr,
    hidden,
    inter_size,
    up_offset,
    row_step,
    alpha,
    limit,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sk,
    stride_be,
    stride_bn,
    stride_zm,
    stride_zn,
    stride_im,
    stride_is,
    stride_ir,
    stride_ll,
    stride_le,
    stride_ls,
    stride_ln,
    stride_lr,
    stride_al,
    stride_ae,
    stride_ar,
    stride_ak,
    stride_qm,
    stride_qr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    WEIGHT_INPUT: tl.constexpr,
    W_FP8: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    SCALE_COLUMNS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
    EARLY: tl.constexpr,
    # W_FP8 (W8A8): x quantized before the kernel (quant_rows.py), e4m3 and its scales
    # (launch_args.QuantRows). Unused otherwise.
    x_quant=None,
):
    pair = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    expert = tl.load(topk_ids_ptr + pair)
    if (expert < 0) | (expert >= num_experts):
        # a program with nothing to do still waits: the kernel's completion must imply the
        # kernel before's (pdl.py), also when every pair is another rank's (expert parallel)
        chain_point(PDL)
        return
    expert = expert.to(tl.int64)
    token = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter_size
    gate_rows = tl.where(n_mask, offs_n, 0) * row_step
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we + offs_k[None, :] * stride_wk
    wg_ptrs = w_base + gate_rows[:, None] * stride_wn
    wu_ptrs = w_base + (gate_rows + up_offset)[:, None] * stride_wn
    # W_FP8 (W8A8): e4m3 rows; a K step of one scale block scales its row sums by the x
    # group's scale and the rows' block scales (else SCALE_COLUMNS, below)
    sg_ptrs = ws_ptr + expert * stride_se + (gate_rows // SCALE_N) * stride_sn
    su_ptrs = ws_ptr + expert * stride_se + ((gate_rows + up_offset) // SCALE_N) * stride_sn
    # SCALE_COLUMNS: the program's rows share one scale row (gate, and up): its scales act
    # on x's columns, and a step may span several scale blocks along K
    first_row = pid_n * BLOCK_N * row_step
    sg_row = ws_ptr + expert * stride_se + (first_row // SCALE_N) * stride_sn
    su_row = ws_ptr + expert * stride_se + ((first_row + up_offset) // SCALE_N) * stride_sn
    if EARLY:  # the first K step's weight tiles, loaded before the chain point: they stream
        # while the kernel before still runs (pdl.py) and depend on nothing it writes
        k_ok = offs_k < hidden
        w_g = tl.load(wg_ptrs, mask=n_mask[:, None] & k_ok[None, :], other=0.0)
        if GATED:
            w_u = tl.load(wu_ptrs, mask=n_mask[:, None] & k_ok[None, :], other=0.0)
    chain_point(PDL)
    # LoRA operands first (a few KB): their loads overlap the weight stream below
    offs_r = tl.arange(0, BLOCK_R)
    if HAS_LORA:
        slot = tl.load(slots_ptr + token)
        has = (slot >= 0) & (slot < num_slots)
        slot = tl.where(has, slot, 0).to(tl.int64)
        slot_rank = tl.where(has, tl.load(ranks_ptr + slot), 0)  # 0 without an adapter
        r_ok = offs_r < tl.minimum(rank, slot_rank)
        i_ptrs = inter_ptr + pair * stride_im + offs_r * stride_ir
        b_ptrs = (
            lora_b_ptr
            + slot * stride_ll
            + expert * stride_le
            + offs_n[:, None] * stride_ln
            + offs_r[None, :] * stride_lr
        )
        nr_mask = n_mask[:, None] & r_ok[None, :]
        t_g = tl.load(i_ptrs, mask=r_ok, other=0.0)
        b_g = tl.load(b_ptrs, mask=nr_mask, other=0.0)
        if GATED:
            t_u = tl.load(i_ptrs + stride_is, mask=r_ok, other=0.0)
            b_u = tl.load(b_ptrs + stride_ls, mask=nr_mask, other=0.0)
        q_ok = offs_r < tl.minimum(z_rank, slot_rank)
        a_ptrs = (
            lora_a2_ptr
            + slot * stride_al
            + expert * stride_ae
            + offs_r[None, :] * stride_ar
            + offs_n[:, None] * stride_ak
        )
        a2 = tl.load(a_ptrs, mask=n_mask[:, None] & q_ok[None, :], other=0.0)
    x_ptrs = x_ptr + token * stride_xm + offs_k * stride_xk
    if W_FP8:
        xq_ptrs = x_quant.xq_ptr + token * x_quant.stride_xqm + offs_k * x_quant.stride_xqk
        xs_row = x_quant.xs_ptr + token * x_quant.stride_xsm
    else:
        xs_row = x_ptr  # never read (SCALE_COLUMNS needs W_FP8)
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if EARLY:  # the first step, from the tiles loaded early (the loop starts at the second)
        if W_FP8:  # the step's e4m3 group and its scale, as stored
            xv = tl.load(xq_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            sa = tl.load(xs_row)
        else:
            xv = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            sa = 1.0  # unused: block_scaled passes serving-dtype products through
        xg, xu = _scaled_inputs(
            xv, xs_row, x_quant, sg_row, su_row, stride_sk, offs_k, k_ok, GATED,
            SCALE_COLUMNS, SCALE_K,
        )  # fmt: skip
        d_g = tl.sum(w_g.to(tl.float32) * xg[None, :], axis=1)
        acc_g += block_scaled(d_g, sa, sg_ptrs, 0, stride_sk, n_mask, W_FP8, SCALE_K, SCALE_COLUMNS)
        if GATED:
            d_u = tl.sum(w_u.to(tl.float32) * xu[None, :], axis=1)
            acc_u += block_scaled(
                d_u, sa, su_ptrs, 0, stride_sk, n_mask, W_FP8, SCALE_K, SCALE_COLUMNS
            )
        x_ptrs += BLOCK_K * stride_xk
        if W_FP8:
            xq_ptrs += BLOCK_K * x_quant.stride_xqk
        wg_ptrs += BLOCK_K * stride_wk
        wu_ptrs += BLOCK_K * stride_wk
    for k0 in range(BLOCK_K if EARLY else 0, hidden, BLOCK_K):
        k_ok = (k0 + offs_k) < hidden
        if W_FP8:
            xv = tl.load(xq_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            sa = tl.load(xs_row + (k0 // SCALE_K) * x_quant.stride_xsg)
        else:
            xv = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            sa = 1.0
        xg, xu = _scaled_inputs(
            xv, xs_row, x_quant, sg_row, su_row, stride_sk, k0 + offs_k, k_ok, GATED,
            SCALE_COLUMNS, SCALE_K,
        )  # fmt: skip
        d_g = _rows_dot(wg_ptrs, xg, k_ok[None, :])
        acc_g += block_scaled(
            d_g, sa, sg_ptrs, k0, stride_sk, n_mask, W_FP8, SCALE_K, SCALE_COLUMNS
        )
        if GATED:
            d_u = _rows_dot(wu_ptrs, xu, k_ok[None, :])
            acc_u += block_scaled(
                d_u, sa, su_ptrs, k0, stride_sk, n_mask, W_FP8, SCALE_K, SCALE_COLUMNS
            )
        x_ptrs += BLOCK_K * stride_xk
        if W_FP8:
            xq_ptrs += BLOCK_K * x_quant.stride_xqk
        wg_ptrs += BLOCK_K * stride_wk
        wu_ptrs += BLOCK_K * stride_wk
    if HAS_LORA:  # zeros when the token has no adapter
        acc_g += tl.sum(b_g.to(tl.float32) * t_g[None, :], axis=1)
        if GATED:
            acc_u += tl.sum(b_u.to(tl.float32) * t_u[None, :], axis=1)
    if WEIGHT_INPUT:
        g = tl.load(topk_weights_ptr + pair).to(tl.float32)
        acc_g = acc_g * g
        acc_u = acc_u * g
    if HAS_BIAS:
        b_base = b_ptr + expert * stride_be
        acc_g += tl.load(b_base + gate_rows * stride_bn, mask=n_mask, other=0.0).to(tl.float32)
        if GATED:
            acc_u += tl.load(
                b_base + (gate_rows + up_offset) * stride_bn, mask=n_mask, other=0.0
            ).to(tl.float32)
    z = as_stored(apply_act(acc_g, acc_u, ACT, alpha, limit), z_ptr.dtype.element_ty)
    tl.store(z_ptr + pair * stride_zm + offs_n * stride_zn, z, mask=n_mask)
    if HAS_LORA:
        # z shrink of these units: z (as stored) times A2[slot, e][:, units], summed over the
        # units into z_inter[pair] by every N program of the pair
        part = tl.sum(a2.to(tl.float32) * z.to(tl.float32)[:, None], axis=0)
        q_ptrs = z_inter_ptr + pair * stride_qm + offs_r * stride_qr
        tl.atomic_add(q_ptrs, part, mask=q_ok, sem="relaxed")


def decode_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor | None,
    topk_ids: torch.Tensor,
    *,
    activation: Activation,
    alpha: float,
    limit: float,
    topk_weights: torch.Tensor | None = None,
    token_slots: torch.Tensor | None = None,
    inter: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    lora_a2: torch.Tensor | None = None,
    z_inter: torch.Tensor | None = None,
    lora_ranks: torch.Tensor | None = None,
    tiles: GemmTiles,
    pdl: bool = False,
    chained: bool = False,
    early: bool = False,
    w_scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] = (128, 128),
    x_quant: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, S*I, H] (x's dtype, or e4m3 with w_scale: fp32 block scales
    [E, ceil(S*I / bn), ceil(H / bk)] of scale_block [bn, bk], or per-channel [E, S*I];
    then W8A8 as the GEMMs quantize: each step's x group (BLOCK_K == bk; any BLOCK_K where
    each program's rows share a scale block, the scales then applied to x's columns), or
    the row by its whole-row scale; products summed in fp32), b13 [E, S*I] | None, topk_ids [T, K]; LoRA: inter
    [P, S, R] fp32 (decode_shrink, or its all-gather), lora_b (w13_b) [L, E, S, I, R],
    lora_a2 (w2_a) [L, E, R2, I] and z_inter [P, R2] fp32 zeros, into which the z shrink is
    added; lora_ranks [L] int32 (LoRABank.ranks; None: every slot at R): the LoRA terms stop
    at each slot's real rank; topk_weights [T, K] only for weights_on_input; tiles: the GEMV tiles (BLOCK_N
    rows of a pair per program, BLOCK_K per step). Returns z [P, I] in x's dtype.
    early: the first K step's weight tiles load before the chain point (TileConfig.pdl;
    runs in the interpreter too); pdl (tiling.plan decided it): the chain point's
    PDL instructions; chained: launched with PDL after the kernel before it in the layer
    (never the layer's first). x_quant (e4m3 w13 only): x quantized before the kernel
    (quant_rows), read instead of x by the base GEMV."""
    block_n, block_k = tiles.block_n, tiles.block_k
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    parts = activation.width_factor
    num_experts, rows, _ = w13.shape
    inter_size = rows // parts
    num_pairs = num_tokens * top_k
    check_shape("w13", w13, (num_experts, parts * inter_size, hidden))
    fp8 = w_scale is not None
    check_weight_dtype("w13", w13, x, fp8)
    interleaved = activation is Activation.SWIGLUOAI  # gate / up rows interleaved
    row_step, up_offset = gate_up_rows(parts, interleaved, inter_size)
    # where each program's rows share their block scales, a step other than one scale
    # block applies them to x's columns (fp8_tiles.py)
    shared = (
        fp8
        and w_scale.dim() == 3
        and rows_share_scale_block(block_n, row_step, up_offset, scale_block[0])
    )
    columns = shared and block_k != scale_block[1]
    if fp8:
        check_fp8_weight("w13", w13, w_scale, scale_block, block_k, shared)
    if b13 is not None:
        check_shape("b13", b13, (num_experts, rows))
    has_lora = lora_b is not None
    if has_lora:
        check_shape("lora w13_b", lora_b, (None, num_experts, parts, inter_size, None))
        check_dtype_match("lora w13_b", lora_b, x)
        check_shape("LoRA intermediate", inter, (num_pairs, parts, lora_b.shape[4]))
        check_shape("lora w2_a", lora_a2, (lora_b.shape[0], num_experts, None, inter_size))
        check_shape("z-shrink intermediate", z_inter, (num_pairs, lora_a2.shape[2]))
    z = workspace(num_pairs, inter_size, dtype=x.dtype, device=x.device)
    rank = lora_b.shape[4] if has_lora else 1
    z_rank = lora_a2.shape[2] if has_lora else 1
    dummy = x  # never read: its constexpr flag is off
    grid = (num_pairs, triton.cdiv(inter_size, block_n))
    _decode_up_kernel[grid](
        x_ptr=x,
        w_ptr=w13,
        b_ptr=b13 if b13 is not None else dummy,
        z_ptr=z,
        topk_ids_ptr=topk_ids,
        topk_weights_ptr=topk_weights.reshape(-1) if topk_weights is not None else dummy,
        slots_ptr=token_slots if has_lora else dummy,
        inter_ptr=inter if has_lora else dummy,
        lora_b_ptr=lora_b if has_lora else dummy,
        lora_a2_ptr=lora_a2 if has_lora else dummy,
        z_inter_ptr=z_inter if has_lora else dummy,
        top_k=top_k,
        num_experts=num_experts,
        num_slots=lora_b.shape[0] if has_lora else 0,
        rank=rank,
        z_rank=z_rank,
        ranks_ptr=slot_ranks(lora_b, lora_ranks, 4) if has_lora else dummy,
        hidden=hidden,
        inter_size=inter_size,
        up_offset=up_offset,
        row_step=row_step,
        alpha=alpha,
        limit=limit,
        **strides("x", x, "mk"),
        **strides("w", w13, "enk"),
        **strides("b", b13, "en"),
        **strides("z", z, "mn"),
        **strides("i", inter if has_lora else None, "msr"),
        **strides("l", lora_b if has_lora else None, "lesnr"),
        **strides("a", lora_a2 if has_lora else None, "lerk"),
        **strides("q", z_inter if has_lora else None, "mr"),
        GATED=activation.is_gated,
        ACT=act_code(activation),
        HAS_BIAS=b13 is not None,
        HAS_LORA=has_lora,
        WEIGHT_INPUT=topk_weights is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_R=max(16, triton.next_power_of_2(max(rank, z_rank))),
        PDL=pdl,
        EARLY=early,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        launch_pdl=pdl and chained,
        **fp8_scale_args(w_scale, scale_block, block_k, dummy),
        SCALE_COLUMNS=columns,
        **quantized_input_args("x", x, x_quant, fp8, w_scale, scale_block),
    )
    return z
