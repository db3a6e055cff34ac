"""Decode-path down GEMV with the top-k reduction fused: y[t, n] = sum over the token's K
pairs of w_j * (z[p] @ w2[e_j]^T + LoRA expand (+ b2)), one program per (token, BLOCK_N
columns of H), straight from the top-k ids (no alignment, no [P, H] intermediate, no
reduce launch).

A program loads a [K, BLOCK_N, BLOCK_K] tile per step (BLOCK_N rows of each of the
token's K experts), so a token's whole down read is in flight in few steps even when
H / BLOCK_N programs do not fill the GPU. Sums in fp32; the output is rounded once.

LoRA: the z-shrink intermediate z_inter [P, R] (fp32, added up by the decode up kernel)
times B2 rows, in fp32. B2 may hold only the columns [lora_n_offset, + its rows) of y
(fully sharded LoRA: this rank's H slice); other columns get no delta.
Pairs routed outside [0, E) contribute nothing.

Legend: T tokens, K top-k, P = T*K pairs, E experts, H hidden, I intermediate, R rank.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import InputError
from ..tiling.config import GemmTiles
from ..tiling.geometry import rank_block, rows_share_scale_block
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

MAX_TILE = 16384  # elements of a step's [K, BLOCK_N, BLOCK_K] tile (see decode_down)


@triton.jit
def _decode_down_kernel(
    z_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    topk_ids_ptr,
    topk_weights_ptr,
    slots_ptr,
    z_inter_ptr,
    lora_b_ptr,
    top_k,
    num_experts,
    num_slots,
    rank,
    ranks_ptr,
    inter_size,
    hidden,
    lora_n_offset,
    lora_n_size,
    stride_zm,
    stride_zk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sk,
    stride_be,
    stride_bn,
    stride_ym,
    stride_yn,
    stride_qm,
    stride_qr,
    stride_ll,
    stride_le,
    stride_ln,
    stride_lr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    ADD: tl.constexpr,
    W_FP8: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    SCALE_COLUMNS: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
    EARLY: tl.constexpr,
    # W_FP8 (W8A8): z quantized before the kernel (quant_rows.py), e4m3 and its scales
    # (launch_args.QuantRows). Unused otherwise.
    z_quant=None,
):
    token = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_j = tl.arange(0, BLOCK_J)
    pair = token * top_k + offs_j
    expert = tl.load(topk_ids_ptr + pair, mask=offs_j < top_k, other=-1)
    live = (expert >= 0) & (expert < num_experts)
    expert = tl.where(live, expert, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    jn_mask = live[:, None] & n_mask[None, :]
    w_ptrs = (
        w_ptr
        + expert[:, None, None] * stride_we
        + tl.where(n_mask, offs_n, 0)[None, :, None] * stride_wn
        + offs_k[None, None, :] * stride_wk
    )
    # W_FP8 (W8A8): e4m3 rows; a K step of one scale block scales each pair's row sums by
    # its z group's scale and the rows' block scales (else SCALE_COLUMNS, below)
    s_ptrs = (
        ws_ptr
        + expert[:, None] * stride_se
        + (tl.where(n_mask, offs_n, 0) // SCALE_N)[None, :] * stride_sn
    )
    # SCALE_COLUMNS: the program's rows share one scale row per expert: its scales act on
    # z's columns, and a step may span several scale blocks along K
    s_rows = ws_ptr + expert[:, None] * stride_se + ((pid_n * BLOCK_N) // SCALE_N) * stride_sn
    if EARLY:  # the first K step's weight tile, loaded before the chain point: it streams
        # while the up kernel still runs (pdl.py) and depends on nothing that kernel writes
        k_ok = offs_k < inter_size
        w = tl.load(w_ptrs, mask=jn_mask[:, :, None] & k_ok[None, None, :], other=0.0)
    chain_point(PDL)
    # LoRA operands first (a few KB): their loads overlap the weight stream below
    if HAS_LORA:
        slot = tl.load(slots_ptr + token)
        has = (slot >= 0) & (slot < num_slots)
        offs_r = tl.arange(0, BLOCK_R)
        slot_rank = tl.load(ranks_ptr + tl.where(has, slot, 0))
        r_ok = offs_r < tl.where(has, tl.minimum(rank, slot_rank), 0)  # none without adapter
        offs_b = offs_n - lora_n_offset
        b_ok = n_mask & (offs_b >= 0) & (offs_b < lora_n_size)
        t = tl.load(
            z_inter_ptr + pair[:, None] * stride_qm + offs_r[None, :] * stride_qr,
            mask=live[:, None] & r_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            lora_b_ptr
            + tl.where(has, slot, 0).to(tl.int64) * stride_ll
            + expert[:, None, None] * stride_le
            + tl.where(b_ok, offs_b, 0)[None, :, None] * stride_ln
            + offs_r[None, None, :] * stride_lr,
            mask=(live[:, None] & b_ok[None, :])[:, :, None] & r_ok[None, None, :],
            other=0.0,
        )
    z_ptrs = z_ptr + pair[:, None] * stride_zm + offs_k[None, :] * stride_zk
    if W_FP8:
        zq_ptrs = (
            z_quant.xq_ptr
            + pair[:, None] * z_quant.stride_xqm
            + offs_k[None, :] * z_quant.stride_xqk
        )
        zs_ptrs = z_quant.xs_ptr + pair[:, None] * z_quant.stride_xsm
    acc = tl.zeros((BLOCK_J, BLOCK_N), dtype=tl.float32)
    if EARLY:  # the first step, from the tile loaded early (the loop starts at the second)
        if W_FP8:  # the step's e4m3 groups and their scales, as stored
            zt = tl.load(zq_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            sa = tl.load(zs_ptrs, mask=live[:, None], other=0.0)
        else:
            zt = tl.load(z_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            sa = 1.0  # unused: block_scaled passes serving-dtype products through
        if SCALE_COLUMNS:
            zt = scaled_columns(zt, zs_ptrs, z_quant.stride_xsg, s_rows, stride_sk, offs_k[None, :],
                                live[:, None] & k_ok[None, :], SCALE_K)  # fmt: skip
        d = tl.sum(w.to(tl.float32) * zt[:, None, :], axis=2)
        acc += block_scaled(d, sa, s_ptrs, 0, stride_sk, jn_mask, W_FP8, SCALE_K, SCALE_COLUMNS)
        z_ptrs += BLOCK_K * stride_zk
        if W_FP8:
            zq_ptrs += BLOCK_K * z_quant.stride_xqk
        w_ptrs += BLOCK_K * stride_wk
    for k0 in range(BLOCK_K if EARLY else 0, inter_size, BLOCK_K):
        k_ok = (k0 + offs_k) < inter_size
        if W_FP8:
            zt = tl.load(zq_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            sa = tl.load(
                zs_ptrs + (k0 // SCALE_K) * z_quant.stride_xsg, mask=live[:, None], other=0.0
            )
        else:
            zt = tl.load(z_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            sa = 1.0
        if SCALE_COLUMNS:
            zt = scaled_columns(zt, zs_ptrs, z_quant.stride_xsg, s_rows, stride_sk,
                                (k0 + offs_k)[None, :], live[:, None] & k_ok[None, :],
                                SCALE_K)  # fmt: skip
        w = tl.load(w_ptrs, mask=jn_mask[:, :, None] & k_ok[None, None, :], other=0.0)
        d = tl.sum(w.to(tl.float32) * zt[:, None, :], axis=2)
        acc += block_scaled(d, sa, s_ptrs, k0, stride_sk, jn_mask, W_FP8, SCALE_K, SCALE_COLUMNS)
        z_ptrs += BLOCK_K * stride_zk
        if W_FP8:
            zq_ptrs += BLOCK_K * z_quant.stride_xqk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_LORA:  # zeros when the token has no adapter
        acc += tl.sum(b.to(tl.float32) * t[:, None, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(
            b_ptr + expert[:, None] * stride_be + offs_n[None, :] * stride_bn,
            mask=jn_mask,
            other=0.0,
        ).to(tl.float32)
    if MUL_WEIGHT:
        g = tl.load(topk_weights_ptr + pair, mask=live, other=0.0).to(tl.float32)
        acc = acc * g[:, None]
    y = tl.sum(tl.where(jn_mask, acc, 0.0), axis=0)
    y_ptrs = y_ptr + token * stride_ym + offs_n * stride_yn
    if ADD:
        y += tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, as_stored(y, y_ptr.dtype.element_ty), mask=n_mask)


def decode_down(
    z: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    topk_ids: torch.Tensor,
    *,
    topk_weights: torch.Tensor | None,
    token_slots: torch.Tensor | None = None,
    z_inter: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    lora_n_offset: int = 0,
    lora_ranks: torch.Tensor | None = None,
    tiles: GemmTiles,
    out: torch.Tensor | None = None,
    add: bool = False,
    pdl: bool = False,
    chained: bool = False,
    early: bool = False,
    w_scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] = (128, 128),
    z_quant: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """z [P, I] (decode_up), w2 [E, H, I] (z's dtype, or e4m3 with w_scale: fp32 block
    scales [E, ceil(H / bn), ceil(I / bk)] of scale_block [bn, bk], or per-channel
    [E, H]; then W8A8 as decode_up: a step of bk columns, or any step where each program's
    rows share a scale block, or whole-row scales per pair), b2 [E, H] | None, topk_ids
    [T, K]; LoRA: z_inter
    [P, R] fp32 and lora_b (w2_b) [L, E, H_b, R] holding y's columns [lora_n_offset, + H_b);
    lora_ranks [L] int32 (LoRABank.ranks; None: every slot at R); topk_weights [T, K]
    (None: applied to the input). Returns y [T, H] in z's dtype (into
    `out` if given; add=True adds to it). early / pdl / chained: as decode_up's."""
    block_n = tiles.block_n
    num_tokens, top_k = topk_ids.shape
    num_pairs, inter_size = z.shape
    check_shape("z", z, (num_tokens * top_k, None))
    num_experts, hidden, _ = w2.shape
    check_shape("w2", w2, (num_experts, hidden, inter_size))
    fp8 = w_scale is not None
    check_weight_dtype("w2", w2, z, fp8)
    if b2 is not None:
        check_shape("b2", b2, (num_experts, hidden))
    has_lora = lora_b is not None
    if has_lora:
        check_shape("lora w2_b", lora_b, (None, num_experts, None, None))
        check_dtype_match("lora w2_b", lora_b, z)
        check_shape("z-shrink intermediate", z_inter, (num_pairs, lora_b.shape[3]))
        if not 0 <= lora_n_offset <= hidden - lora_b.shape[2]:
            raise InputError(
                "lora w2_b",
                f"rows [{lora_n_offset}, {lora_n_offset + lora_b.shape[2]}) of y",
                f"a column range inside [0, H = {hidden})",
            )
    if out is None:
        out = workspace(num_tokens, hidden, dtype=z.dtype, device=z.device)
    check_shape("out", out, (num_tokens, hidden))
    rank = lora_b.shape[3] if has_lora else 1
    block_j = max(2, triton.next_power_of_2(top_k))
    # a step's tile is [K, BLOCK_N, BLOCK_K] fp32 in registers: large top-k (K > 8) gets a
    # narrower K step so the tile stays at the 8 x 16 x 128 elements tried for K = 8
    block_k = max(16, min(tiles.block_k, MAX_TILE // (block_j * block_n)))
    # where each program's rows share their block scales, a step other than one scale
    # block applies them to z's columns (fp8_tiles.py); else a step is one scale block
    shared = fp8 and w_scale.dim() == 3 and rows_share_scale_block(block_n, 1, 0, scale_block[0])
    if fp8 and w_scale.dim() == 3 and not shared:
        block_k = scale_block[1]
    columns = shared and block_k != scale_block[1]
    if fp8:
        check_fp8_weight("w2", w2, w_scale, scale_block, block_k, shared)
    dummy = z  # never read: its constexpr flag is off
    grid = (num_tokens, triton.cdiv(hidden, block_n))
    _decode_down_kernel[grid](
        z_ptr=z,
        w_ptr=w2,
        b_ptr=b2 if b2 is not None else dummy,
        y_ptr=out,
        topk_ids_ptr=topk_ids,
        topk_weights_ptr=topk_weights.reshape(-1) if topk_weights is not None else dummy,
        slots_ptr=token_slots if has_lora else dummy,
        z_inter_ptr=z_inter if has_lora else dummy,
        lora_b_ptr=lora_b if has_lora else dummy,
        top_k=top_k,
        num_experts=num_experts,
        num_slots=lora_b.shape[0] if has_lora else 0,
        rank=rank,
        ranks_ptr=slot_ranks(lora_b, lora_ranks, 3) if has_lora else dummy,
        inter_size=inter_size,
        hidden=hidden,
        lora_n_offset=lora_n_offset,
        lora_n_size=lora_b.shape[2] if has_lora else 0,
        **strides("z", z, "mk"),
        **strides("w", w2, "enk"),
        **strides("b", b2, "en"),
        **strides("y", out, "mn"),
        **strides("q", z_inter if has_lora else None, "mr"),
        **strides("l", lora_b if has_lora else None, "lenr"),
        HAS_BIAS=b2 is not None,
        HAS_LORA=has_lora,
        MUL_WEIGHT=topk_weights is not None,
        ADD=add,
        BLOCK_J=block_j,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_R=rank_block(rank),
        PDL=pdl,
        EARLY=early,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        launch_pdl=pdl and chained,
        **fp8_scale_args(w_scale, scale_block, block_k, dummy),
        SCALE_COLUMNS=columns,
        **quantized_input_args("z", z, z_quant, fp8, w_scale, scale_block),
    )
    return out
