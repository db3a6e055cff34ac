"""Gate/up grouped GEMM with the LoRA delta added before the activation, activation fused.

For each aligned block (one expert) and N tile of I: h = x @ w13[e]^T + LoRA expand of the
fp32 shrink intermediate (unweighted), + b13; z = act(h) written to z [P, I]. Gated
activations load the gate and up rows of the same units in one program, so the
activation runs in the epilogue (gpt-oss: interleaved rows, even gate / odd up).
With weights_on_input (Llama-4) the routing weight scales x, i.e. the GEMM + LoRA terms.
Knobs (docs/kernels.md): the expand before the K loop (expand_first), a half-height variant for
blocks whose second half is padding (half_tail), w13 tiles by TMA (up_tma).

Legend: T tokens, K top-k, P = T*K pairs, E experts, H hidden, I intermediate, R rank.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..activations import Activation
from ..tiling.geometry import next_pow2
from ..tiling.plan import GemmPlan
from .activation import act_code, apply_act
from .align import AlignedPairs
from .checks import (
    check_dtype_match,
    check_fp8_weight,
    check_shape,
    check_weight_dtype,
    fp8_scale_args,
    precision_flags,
    quantized_input_args,
    tma_box_ok,
    workspace,
)
from .fp8_tiles import fp8_mma
from .launch_args import aligned_blocks, strides
from .output import as_stored
from .pdl import chain_point
from .ranks import expand_layout
from .tiles import (
    add_delta,
    block_rows,
    grouped_pid,
    lora_expand,
    mma,
    tail_variants,
    z_rows,
)


@triton.jit
def _expert_up_kernel(
    x_ptr,
    w_ptr,
    w_desc,
    ws_ptr,
    b_ptr,
    z_ptr,
    topk_weights_ptr,
    slots_ptr,
    inter_ptr,
    lora_b_ptr,
    delta_ptr,
    blocks,
    num_pairs,
    top_k,
    num_slots,
    ranks_ptr,
    max_rank,
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
    stride_dm,
    stride_ds,
    stride_dn,
    num_pid_m,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    DELTA: tl.constexpr,
    WEIGHT_INPUT: tl.constexpr,
    Z_SORTED: tl.constexpr,
    EXPAND_FIRST: tl.constexpr,
    TAIL_VARIANTS: tl.constexpr,
    W_TMA: tl.constexpr,
    W_FP8: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SLOTS_PER_DOT: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
    ONE_DOT: tl.constexpr = False,  # the LoRA expand as one 16-bit dot (tiles.expand_dot)
    # W_FP8 (W8A8): x quantized before the GEMM (quant_rows.py), e4m3 [T, H] and its
    # scales [T, G] (launch_args.QuantRows). Unused otherwise.
    x_quant=None,
):
    chain_point(PDL)  # nothing is read before the wait (kernels/pdl.py)
    num_pid_n = tl.cdiv(inter_size, BLOCK_N)
    pid_m, pid_n = grouped_pid(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(blocks.num_padded_ptr):
        return
    expert = tl.load(blocks.block_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    row0 = pid_m * BLOCK_M
    # TAIL_VARIANTS = 2 (half_tail): a block whose second half is all padding (an expert's
    # last block) runs the half-height variant, rows [row0, row0 + BLOCK_M // 2), so the
    # padding costs no MMA there; every other block runs the full one. 1: full blocks only.
    # Inline in both GEMM kernels on purpose: the same choice as a tiles.py helper compiled
    # differently and measured 3% slower at T = 4096 on the H200 (a66485b, kernel_log v16c).
    if TAIL_VARIANTS == 2:
        half = tl.load(blocks.sorted_pair_ids_ptr + row0 + BLOCK_M // 2) >= num_pairs
    for v in tl.static_range(TAIL_VARIANTS):
        run = True
        if TAIL_VARIANTS == 2:
            run = half == (v == 1)
        if run:
            pair, row_valid, slot = block_rows(
                blocks.sorted_pair_ids_ptr,
                slots_ptr,
                row0,
                num_pairs,
                top_k,
                num_slots,
                BLOCK_M >> v,
                HAS_LORA,
            )
            token = (pair // top_k).to(tl.int64)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < inter_size
            gate_rows = tl.where(n_mask, offs_n, 0) * row_step
            offs_k = tl.arange(0, BLOCK_K)
            x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :] * stride_xk
            if W_FP8:
                xq_ptrs = (
                    x_quant.xq_ptr
                    + token[:, None] * x_quant.stride_xqm
                    + offs_k[None, :] * x_quant.stride_xqk
                )
                xs_ptrs = x_quant.xs_ptr + token * x_quant.stride_xsm
            w_base = w_ptr + expert * stride_we + offs_k[:, None] * stride_wk
            wg_ptrs = w_base + gate_rows[None, :] * stride_wn
            wu_ptrs = w_base + (gate_rows + up_offset)[None, :] * stride_wn
            acc_g = tl.zeros((BLOCK_M >> v, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M >> v, BLOCK_N), dtype=tl.float32)
            # two phases, the main K loop and the LoRA expand; EXPAND_FIRST runs the expand first
            # as its own pipelined loop (tiles.lora_expand), else it follows the main loop
            for phase in tl.static_range(2):
                if (phase == 0) != EXPAND_FIRST:
                    for k0 in range(0, hidden, BLOCK_K):
                        k_mask = (k0 + offs_k) < hidden
                        if W_FP8:  # the step's e4m3 group and its scales, as stored
                            a8 = tl.load(
                                xq_ptrs, mask=row_valid[:, None] & k_mask[None, :], other=0.0
                            )
                            sa = tl.load(
                                xs_ptrs + (k0 // SCALE_K) * x_quant.stride_xsg,
                                mask=row_valid,
                                other=0.0,
                            )[:, None]
                            xq_ptrs += BLOCK_K * x_quant.stride_xqk
                        else:
                            xt = tl.load(
                                x_ptrs, mask=row_valid[:, None] & k_mask[None, :], other=0.0
                            )
                        # W_TMA: w13 tiles by TMA; the gate box of a last, partial N tile
                        # reaches into the up rows (or past w13: zeros), columns n_mask drops
                        if W_TMA:
                            wg = w_desc.load([expert.to(tl.int32), pid_n * BLOCK_N, k0])
                            wg = wg.reshape(BLOCK_N, BLOCK_K).trans()
                        else:
                            wg = tl.load(wg_ptrs, mask=k_mask[:, None], other=0.0)
                        # W_FP8 (W8A8): each row's e4m3 x group (BLOCK_K == the scale block's
                        # K side) times the e4m3 tiles, FP8 dots scaled by both sides' scales
                        s_base = ws_ptr + expert * stride_se + (k0 // SCALE_K) * stride_sk
                        if W_FP8:
                            sg_ptrs = s_base + (gate_rows // SCALE_N) * stride_sn
                            acc_g = fp8_mma(a8, sa, wg, acc_g, sg_ptrs, n_mask)
                        else:
                            if UPCAST:
                                xt = xt.to(tl.float32)
                                wg = wg.to(tl.float32)
                            acc_g = mma(xt, wg, acc_g, IEEE)
                        if GATED:
                            if W_TMA:  # up rows: a block of I rows after the gate rows
                                wu = w_desc.load(
                                    [expert.to(tl.int32), up_offset + pid_n * BLOCK_N, k0]
                                )
                                wu = wu.reshape(BLOCK_N, BLOCK_K).trans()
                            else:
                                wu = tl.load(wu_ptrs, mask=k_mask[:, None], other=0.0)
                            if W_FP8:
                                su_ptrs = s_base + ((gate_rows + up_offset) // SCALE_N) * stride_sn
                                acc_u = fp8_mma(a8, sa, wu, acc_u, su_ptrs, n_mask)
                            else:
                                if UPCAST:
                                    wu = wu.to(tl.float32)
                                acc_u = mma(xt, wu, acc_u, IEEE)
                        x_ptrs += BLOCK_K * stride_xk
                        wg_ptrs += BLOCK_K * stride_wk
                        wu_ptrs += BLOCK_K * stride_wk
                else:
                    acc_g, acc_u = _up_lora(
                        acc_g, acc_u, inter_ptr, lora_b_ptr + expert * stride_le, delta_ptr,
                        stride_im, stride_is, stride_ir, stride_ll, stride_ls, stride_ln, stride_lr,
                        stride_dm, stride_ds, stride_dn, pair, slot, num_slots, offs_n, n_mask,
                        ranks_ptr, max_rank, HAS_LORA, DELTA, GATED, BLOCK_L, BLOCK_R, SLOTS_PER_DOT, UPCAST,
                        IEEE, EXPAND_FIRST, ONE_DOT,
                    )  # fmt: skip
            if WEIGHT_INPUT:
                g = tl.load(topk_weights_ptr + pair, mask=row_valid, other=0.0).to(tl.float32)
                acc_g = acc_g * g[:, None]
                acc_u = acc_u * g[:, None]
            if HAS_BIAS:
                b_base = b_ptr + expert * stride_be
                acc_g += tl.load(b_base + gate_rows * stride_bn, mask=n_mask, other=0.0).to(
                    tl.float32
                )[None, :]
                if GATED:
                    acc_u += tl.load(
                        b_base + (gate_rows + up_offset) * stride_bn, mask=n_mask, other=0.0
                    ).to(tl.float32)[None, :]
            z = apply_act(acc_g, acc_u, ACT, alpha, limit)
            z_row = z_rows(row0, pair, BLOCK_M >> v, Z_SORTED)
            z_ptrs = z_ptr + z_row[:, None] * stride_zm + offs_n[None, :] * stride_zn
            z = as_stored(z, z_ptr.dtype.element_ty)
            tl.store(z_ptrs, z, mask=row_valid[:, None] & n_mask[None, :])


@triton.jit
def _up_lora(
    acc_g,
    acc_u,
    inter_ptr,
    b_ptr,
    delta_ptr,
    stride_im,
    stride_is,
    stride_ir,
    stride_ll,
    stride_ls,
    stride_ln,
    stride_lr,
    stride_dm,
    stride_ds,
    stride_dn,
    pair,
    slot,
    num_slots,
    offs_n,
    n_mask,
    ranks_ptr,
    max_rank,
    HAS_LORA: tl.constexpr,
    DELTA: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SLOTS_PER_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    PIPELINED: tl.constexpr,
    ONE_DOT: tl.constexpr,
):
    """The up kernel's LoRA term: the delta rows (lora_delta) or the expand of the fp32
    intermediate (b_ptr at this expert's B); nothing without LoRA."""
    if HAS_LORA:
        if DELTA:  # expanded over the shrink tiles (lora_delta)
            acc_g, acc_u = add_delta(
                acc_g, acc_u, delta_ptr, stride_dm, stride_ds, stride_dn, pair, slot, offs_n,
                n_mask, GATED,
            )  # fmt: skip
        else:
            acc_g, acc_u = lora_expand(
                acc_g, acc_u, inter_ptr, stride_im, stride_is, stride_ir, pair, slot,
                num_slots, b_ptr, stride_ll, stride_ls, stride_ln, stride_lr, offs_n, n_mask,
                ranks_ptr, max_rank, BLOCK_L, BLOCK_R, SLOTS_PER_DOT, GATED, UPCAST, IEEE, PIPELINED,
                ONE_DOT,
            )  # fmt: skip
    return acc_g, acc_u


def expert_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor | None,
    aligned: AlignedPairs,
    gemm: GemmPlan,
    *,
    activation: Activation,
    top_k: int,
    alpha: float,
    limit: float,
    topk_weights: torch.Tensor | None = None,
    token_slots: torch.Tensor | None = None,
    inter: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    lora_ranks: torch.Tensor | None = None,
    tile_rank: int | None = None,
    out: torch.Tensor | None = None,
    pdl: bool = False,
    w_scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] = (128, 128),
    x_quant: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, S*I, H] (x's dtype, or e4m3 with w_scale: fp32 block scales
    [E, ceil(S*I / bn), ceil(H / bk)] of scale_block [bn, bk]; then W8A8: BLOCK_K == bk,
    each K step quantizes its x rows per token in registers and runs FP8 dots; or
    per-channel scales [E, S*I]: the same with each row's scale over all of H),
    b13 [E, S*I] | None; LoRA: inter [P, S, R] fp32 from
    lora_shrink and lora_b [L, E, S, I, R], or instead of inter the expanded delta
    [P, S, I] (lora_delta; lora_b still gives the slot count); topk_weights [T, K] only for
    weights_on_input; gemm: the tiles and knobs (tiling.plan.GemmPlan).
    Returns z [P, I] in x's dtype (padding and dropped pairs unwritten); gemm.z_sorted: z
    [P_pad, I] with a pair's row at its place in aligned.sorted_pair_ids (each block's rows
    contiguous, for the down GEMM's tile loads), padding rows unwritten. gemm.tma: w13's
    tiles copied by the TMA where the layout allows (gate and up rows in two blocks, not
    interleaved; aligned strides). x_quant (e4m3 w13 only): x quantized before the GEMM,
    (e4m3 [T, H], fp32 scales [T, ceil(H / bk)]) from quant_rows, read instead of x."""
    block_n, block_k, z_sorted = gemm.tiles.block_n, gemm.tiles.block_k, gemm.z_sorted
    num_tokens, hidden = x.shape
    parts = activation.width_factor
    num_experts, rows, _ = w13.shape
    inter_size = rows // parts
    check_shape("w13", w13, (num_experts, parts * inter_size, hidden))
    fp8 = w_scale is not None
    check_weight_dtype("w13", w13, x, fp8)
    if fp8:
        check_fp8_weight("w13", w13, w_scale, scale_block, block_k)
    if b13 is not None:
        check_shape("b13", b13, (num_experts, rows))
    quantized = quantized_input_args("x", x, x_quant, fp8, w_scale, scale_block)
    has_lora = lora_b is not None
    if has_lora:
        check_shape("lora w13_b", lora_b, (None, num_experts, parts, inter_size, None))
        check_dtype_match("lora w13_b", lora_b, x)
        if delta is not None:
            check_shape("LoRA delta", delta, (num_tokens * top_k, parts, inter_size))
        else:
            check_shape("LoRA intermediate", inter, (num_tokens * top_k, parts, lora_b.shape[4]))
    num_pairs = num_tokens * top_k
    z_rows = aligned.sorted_pair_ids.shape[0] if z_sorted else num_pairs
    if out is None:
        out = workspace(z_rows, inter_size, dtype=x.dtype, device=x.device)
    check_shape("z", out, (z_rows, inter_size))
    swiglu = activation is Activation.SWIGLUOAI
    ranks, block_r, per_dot = expand_layout(lora_b, lora_ranks, tile_rank, gemm.expand_lanes, 4)
    dummy = x  # never read: its constexpr flag is off
    upcast, ieee = precision_flags(x)
    use_tma = gemm.tma and not swiglu and not fp8 and tma_box_ok(w13, (1, block_n, block_k))
    if use_tma:
        w_desc = TensorDescriptor(w13, list(w13.shape), list(w13.stride()), [1, block_n, block_k])
    else:
        w_desc = w13  # never read: TMA off
    grid = (aligned.num_blocks * triton.cdiv(inter_size, block_n),)
    _expert_up_kernel[grid](
        x_ptr=x,
        w_ptr=w13,
        w_desc=w_desc,
        b_ptr=b13 if b13 is not None else dummy,
        z_ptr=out,
        topk_weights_ptr=topk_weights.reshape(-1) if topk_weights is not None else dummy,
        slots_ptr=token_slots if has_lora else dummy,
        inter_ptr=inter if inter is not None else dummy,
        lora_b_ptr=lora_b if has_lora else dummy,
        delta_ptr=delta if delta is not None else dummy,
        blocks=aligned_blocks(aligned),
        num_pairs=num_pairs,
        top_k=top_k,
        num_slots=lora_b.shape[0] if has_lora else 0,
        ranks_ptr=ranks if ranks is not None else dummy,
        max_rank=lora_b.shape[4] if has_lora else 16,
        hidden=hidden,
        inter_size=inter_size,
        up_offset=1 if swiglu else inter_size,
        row_step=2 if swiglu else 1,
        alpha=alpha,
        limit=limit,
        **strides("x", x, "mk"),
        **strides("w", w13, "enk"),
        **strides("b", b13, "en"),
        **strides("z", out, "mn"),
        **strides("i", inter, "msr"),
        **strides("l", lora_b if has_lora else None, "lesnr"),
        **strides("d", delta, "msn"),
        num_pid_m=aligned.num_blocks,
        GATED=activation.is_gated,
        ACT=act_code(activation),
        HAS_BIAS=b13 is not None,
        HAS_LORA=has_lora,
        DELTA=delta is not None,
        WEIGHT_INPUT=topk_weights is not None,
        Z_SORTED=z_sorted,
        EXPAND_FIRST=gemm.expand_first and has_lora and delta is None,
        TAIL_VARIANTS=tail_variants(gemm.half_tail, aligned.block_m),
        W_TMA=use_tma,
        BLOCK_M=aligned.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_L=next_pow2(lora_b.shape[0]) if has_lora else 1,
        BLOCK_R=block_r,
        SLOTS_PER_DOT=per_dot,
        GROUP_M=gemm.group_m,
        UPCAST=upcast,
        IEEE=ieee,
        num_warps=gemm.tiles.num_warps,
        num_stages=gemm.tiles.num_stages,
        PDL=pdl,
        launch_pdl=pdl,
        ONE_DOT=gemm.expand_one_dot and has_lora and delta is None,
        **fp8_scale_args(w_scale, scale_block, block_k, dummy),
        **quantized,
    )
    return out
