"""Down grouped GEMM with the routing-weighted LoRA delta.

For each aligned block (one expert) and N tile of H: o = z @ w2[e]^T + LoRA expand of the
fp32 shrink intermediate of z, + b2, then times the routing weight (unless the weight was
applied to the input). o [P, H] is written per pair; topk_reduce sums it over K.
Knobs (docs/kernels.md): the expand before the K loop (expand_first), a half-height variant for
blocks whose second half is padding (half_tail), z and w2 tiles by TMA (down_tma), and the
top-k sum by fp32 atomic adds into a [T, H] buffer instead of o (atomic_reduce).

Legend: P = T*K pairs, E experts, H hidden, I intermediate, R rank, L slots.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..errors import InputError
from ..tiling.geometry import next_pow2
from ..tiling.plan import GemmPlan
from .align import AlignedPairs
from .checks import (
    check_dtype_match,
    check_fp8_weight,
    check_shape,
    check_weight_dtype,
    fp8_scale_args,
    precision_flags,
    quantized_input_args,
    tma_tiles_ok,
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
def _expert_down_kernel(
    z_ptr,
    w_ptr,
    z_desc,
    w_desc,
    ws_ptr,
    b_ptr,
    o_ptr,
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
    stride_om,
    stride_on,
    stride_im,
    stride_ir,
    stride_ll,
    stride_le,
    stride_ln,
    stride_lr,
    stride_dm,
    stride_ds,
    stride_dn,
    num_pid_m,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    DELTA: tl.constexpr,
    Z_SORTED: tl.constexpr,
    TMA: tl.constexpr,
    W_FP8: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    ATOMIC: tl.constexpr,
    EXPAND_FIRST: tl.constexpr,
    TAIL_VARIANTS: tl.constexpr,
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
    # W_FP8 (W8A8): z quantized before the GEMM (quant_rows.py), e4m3 [rows of z, I] and
    # its scales [rows of z, G] (launch_args.QuantRows). Unused otherwise.
    z_quant=None,
):
    chain_point(PDL)  # nothing is read before the wait (kernels/pdl.py)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(hidden, BLOCK_N)
    pid_m, pid_n = grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M)
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
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < hidden
            offs_k = tl.arange(0, BLOCK_K)
            z_row = z_rows(row0, pair, BLOCK_M >> v, Z_SORTED)
            z_ptrs = z_ptr + z_row[:, None] * stride_zm + offs_k[None, :] * stride_zk
            if W_FP8:  # z's e4m3 rows and scales, at z's row index
                zq_ptrs = (
                    z_quant.xq_ptr
                    + z_row[:, None] * z_quant.stride_xqm
                    + offs_k[None, :] * z_quant.stride_xqk
                )
                zs_ptrs = z_quant.xs_ptr + z_row * z_quant.stride_xsm
            w_ptrs = (
                w_ptr
                + expert * stride_we
                + offs_k[:, None] * stride_wk
                + tl.where(n_mask, offs_n, 0)[None, :] * stride_wn
            )
            acc = tl.zeros((BLOCK_M >> v, BLOCK_N), dtype=tl.float32)
            # two phases, the main K loop and the LoRA term; EXPAND_FIRST runs the expand first as
            # its own pipelined loop (tiles.lora_expand), else it follows the main loop
            for phase in tl.static_range(2):
                if (phase == 0) != EXPAND_FIRST:
                    for k0 in range(0, inter_size, BLOCK_K):
                        # TMA: tensor-memory-accelerator tile copies (out-of-range reads are zeros);
                        # z's descriptor holds full-height tiles, so the half variant loads z rows
                        if W_FP8:  # the step's e4m3 group and its scales, as stored
                            q_mask = row_valid[:, None] & ((k0 + offs_k) < inter_size)[None, :]
                            a8 = tl.load(zq_ptrs, mask=q_mask, other=0.0)
                            sa = tl.load(
                                zs_ptrs + (k0 // SCALE_K) * z_quant.stride_xsg,
                                mask=row_valid,
                                other=0.0,
                            )[:, None]
                            zq_ptrs += BLOCK_K * z_quant.stride_xqk
                        elif TMA and v == 0:
                            zt = z_desc.load([row0, k0])
                        else:
                            k_mask = (k0 + offs_k) < inter_size
                            zt = tl.load(
                                z_ptrs, mask=row_valid[:, None] & k_mask[None, :], other=0.0
                            )
                        if TMA:
                            w = w_desc.load([expert.to(tl.int32), pid_n * BLOCK_N, k0])
                            w = w.reshape(BLOCK_N, BLOCK_K).trans()
                        else:
                            w = tl.load(
                                w_ptrs, mask=((k0 + offs_k) < inter_size)[:, None], other=0.0
                            )
                        if W_FP8:  # W8A8: the e4m3 z group times the e4m3 tile, an FP8 dot
                            s_ptrs = (
                                ws_ptr
                                + expert * stride_se
                                + (k0 // SCALE_K) * stride_sk
                                + (tl.where(n_mask, offs_n, 0) // SCALE_N) * stride_sn
                            )
                            acc = fp8_mma(a8, sa, w, acc, s_ptrs, n_mask)
                        else:
                            if UPCAST:
                                zt = zt.to(tl.float32)
                                w = w.to(tl.float32)
                            acc = mma(zt, w, acc, IEEE)
                        z_ptrs += BLOCK_K * stride_zk
                        w_ptrs += BLOCK_K * stride_wk
                else:
                    acc = _down_lora(
                        acc, inter_ptr, lora_b_ptr + expert * stride_le, delta_ptr, stride_im,
                        stride_ir, stride_ll, stride_ln, stride_lr, stride_dm, stride_dn, pair, slot,
                        num_slots, offs_n, n_mask, ranks_ptr, max_rank, lora_n_offset,
                        lora_n_size, HAS_LORA, DELTA, BLOCK_L, BLOCK_R, SLOTS_PER_DOT, UPCAST, IEEE,
                        EXPAND_FIRST, ONE_DOT,
                    )  # fmt: skip
            if HAS_BIAS:
                acc += tl.load(
                    b_ptr + expert * stride_be + offs_n * stride_bn, mask=n_mask, other=0.0
                ).to(tl.float32)[None, :]
            if MUL_WEIGHT:
                g = tl.load(topk_weights_ptr + pair, mask=row_valid, other=0.0).to(tl.float32)
                acc = acc * g[:, None]
            o_mask = row_valid[:, None] & n_mask[None, :]
            if ATOMIC:  # the top-k sum: fp32 adds into the token's row of o [T, H]
                o_row = (pair // top_k).to(tl.int64)
                o_ptrs = o_ptr + o_row[:, None] * stride_om + offs_n[None, :] * stride_on
                tl.atomic_add(o_ptrs, acc, mask=o_mask, sem="relaxed")
            else:
                o_ptrs = (
                    o_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
                )
                tl.store(o_ptrs, as_stored(acc, o_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _down_lora(
    acc,
    inter_ptr,
    b_ptr,
    delta_ptr,
    stride_im,
    stride_ir,
    stride_ll,
    stride_ln,
    stride_lr,
    stride_dm,
    stride_dn,
    pair,
    slot,
    num_slots,
    offs_n,
    n_mask,
    ranks_ptr,
    max_rank,
    lora_n_offset,
    lora_n_size,
    HAS_LORA: tl.constexpr,
    DELTA: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SLOTS_PER_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    PIPELINED: tl.constexpr,
    ONE_DOT: tl.constexpr,
):
    """The down kernel's LoRA term: the delta rows (lora_delta) or the expand of the fp32
    intermediate (b_ptr at this expert's B2); nothing without LoRA."""
    if HAS_LORA:
        if DELTA:  # expanded over the shrink tiles (lora_delta; whole-H B2 only)
            acc, _ = add_delta(
                acc, acc, delta_ptr, stride_dm, 0, stride_dn, pair, slot, offs_n, n_mask, False
            )
        else:
            # B2 may hold only the columns [lora_n_offset, + lora_n_size) of o (fully sharded
            # LoRA: this rank's H slice): other columns load zeros and get no delta.
            offs_b = offs_n - lora_n_offset
            b_mask = n_mask & (offs_b >= 0) & (offs_b < lora_n_size)
            acc, _ = lora_expand(
                acc, acc, inter_ptr, stride_im, 0, stride_ir, pair, slot, num_slots, b_ptr,
                stride_ll, 0, stride_ln, stride_lr, tl.where(b_mask, offs_b, 0), b_mask,
                ranks_ptr, max_rank, BLOCK_L, BLOCK_R, SLOTS_PER_DOT, False, UPCAST, IEEE, PIPELINED,
                ONE_DOT,
            )  # fmt: skip
    return acc


def expert_down(*args, **kwargs) -> torch.Tensor:
    """Launches the down GEMM (arguments and result: expert_down_launch)."""
    grid, kw, out = expert_down_launch(*args, **kwargs)
    _expert_down_kernel[grid](**kw)
    return out


def expert_down_launch(
    z: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    aligned: AlignedPairs,
    gemm: GemmPlan,
    *,
    top_k: int,
    topk_weights: torch.Tensor | None,
    token_slots: torch.Tensor | None = None,
    inter: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    lora_n_offset: int = 0,
    num_pairs: int | None = None,
    delta: torch.Tensor | None = None,
    lora_ranks: torch.Tensor | None = None,
    tile_rank: int | None = None,
    out: torch.Tensor | None = None,
    sum_into: torch.Tensor | None = None,
    pdl: bool = False,
    w_scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] = (128, 128),
    z_quant: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[tuple[int], dict, torch.Tensor]:
    """(grid, the kernel's keyword arguments, the result) of a down GEMM launch, checked
    and allocated; expert_down launches it.

    z [P, I] (gemm.z_sorted: [P_pad, I] in the sorted order, with num_pairs = P;
    gemm.tma: its tiles and w2's copied by the TMA where the shapes allow), w2 [E, H, I], b2 [E, H] | None; LoRA: inter [P, 1, R] or [P, R] fp32 and
    lora_b [L, E, H_b, R] holding o's columns [lora_n_offset, lora_n_offset + H_b) (the whole
    H by default; an H/tp slice under fully sharded LoRA); topk_weights [T, K] (None: weights
    were applied to the input); instead of inter, the expanded delta [P, 1, H] (lora_delta,
    whole-H lora_b only). Returns o [P, H] in z's dtype (rows of dropped pairs unwritten);
    with sum_into (fp32 [T, H], T = P / top_k), each pair's row is atomically added into
    its token's row there instead (the top-k reduce, kernels/atomic_reduce.py) and
    sum_into is returned. gemm: the tiles and knobs (tiling.plan.GemmPlan). w_scale: w2
    is e4m3 with fp32 block scales [E, ceil(H / bn), ceil(I / bk)] of scale_block [bn, bk];
    then W8A8 (no TMA): BLOCK_K == bk, each K step quantizes its z rows per token in
    registers and runs an FP8 dot; or per-channel scales [E, H]: the same with each row's
    scale over all of I. z_quant (e4m3 w2 only): z quantized before the GEMM (e4m3 like z,
    fp32 scales [rows of z, ceil(I / bk)], or [rows of z, 1] per channel) from quant_rows,
    which the base GEMM reads instead of z (the LoRA part reads z)."""
    block_n, block_k, z_sorted = gemm.tiles.block_n, gemm.tiles.block_k, gemm.z_sorted
    inter_size = z.shape[1]
    if not z_sorted:
        num_pairs = z.shape[0]
    elif num_pairs is None:
        raise InputError("num_pairs", "None with z_sorted", "T * K (z rows are sorted slots)")
    check_shape("z", z, (aligned.sorted_pair_ids.shape[0] if z_sorted else num_pairs, None))
    num_experts, hidden, _ = w2.shape
    check_shape("w2", w2, (num_experts, hidden, inter_size))
    fp8 = w_scale is not None
    check_weight_dtype("w2", w2, z, fp8)
    if fp8:
        check_fp8_weight("w2", w2, w_scale, scale_block, block_k)
    if b2 is not None:
        check_shape("b2", b2, (num_experts, hidden))
    has_lora = lora_b is not None
    if has_lora:
        check_shape("lora w2_b", lora_b, (None, num_experts, None, None))
        check_dtype_match("lora w2_b", lora_b, z)
        if not 0 <= lora_n_offset <= hidden - lora_b.shape[2]:
            raise InputError(
                "lora w2_b",
                f"rows [{lora_n_offset}, {lora_n_offset + lora_b.shape[2]}) of o",
                f"a column range inside [0, H = {hidden})",
            )
        if delta is not None:
            check_shape("LoRA delta", delta, (num_pairs, 1, hidden))
            if lora_b.shape[2] != hidden:
                raise InputError(
                    "delta",
                    f"given with lora w2_b holding {lora_b.shape[2]} of H = {hidden} rows",
                    "whole-H w2_b; under fully sharded LoRA pass inter, not delta",
                )
        else:
            inter = inter.reshape(num_pairs, lora_b.shape[3])
    if sum_into is not None:
        check_shape("sum_into", sum_into, (num_pairs // top_k, hidden))
        if sum_into.dtype != torch.float32:
            raise InputError("sum_into", f"dtype {sum_into.dtype}", "an fp32 [T, H] buffer")
        out = sum_into
    elif out is None:
        out = workspace(num_pairs, hidden, dtype=z.dtype, device=z.device)
    ranks, block_r, per_dot = expand_layout(lora_b, lora_ranks, tile_rank, gemm.expand_lanes, 3)
    dummy = z  # never read: its constexpr flag is off
    upcast, ieee = precision_flags(z)
    block_m = aligned.block_m
    use_tma = gemm.tma and z_sorted and not fp8 and tma_tiles_ok(z, w2, block_m, block_n, block_k)
    if use_tma:
        z_desc = TensorDescriptor(z, list(z.shape), list(z.stride()), [block_m, block_k])
        w_desc = TensorDescriptor(w2, list(w2.shape), list(w2.stride()), [1, block_n, block_k])
    else:
        z_desc = w_desc = z  # never read: TMA off
    grid = (aligned.num_blocks * triton.cdiv(hidden, block_n),)
    kw = dict(
        z_ptr=z,
        w_ptr=w2,
        z_desc=z_desc,
        w_desc=w_desc,
        b_ptr=b2 if b2 is not None else dummy,
        o_ptr=out,
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
        max_rank=lora_b.shape[3] if has_lora else 16,
        inter_size=inter_size,
        hidden=hidden,
        lora_n_offset=lora_n_offset,
        lora_n_size=lora_b.shape[2] if has_lora else 0,
        **strides("z", z, "mk"),
        **strides("w", w2, "enk"),
        **strides("b", b2, "en"),
        **strides("o", out, "mn"),
        stride_im=inter.stride(0) if inter is not None else 0,
        stride_ir=inter.stride(1) if inter is not None else 0,
        **strides("l", lora_b if has_lora else None, "lenr"),
        **strides("d", delta, "msn"),
        num_pid_m=aligned.num_blocks,
        HAS_BIAS=b2 is not None,
        HAS_LORA=has_lora,
        DELTA=delta is not None,
        Z_SORTED=z_sorted,
        TMA=use_tma,
        MUL_WEIGHT=topk_weights is not None,
        ATOMIC=sum_into is not None,
        EXPAND_FIRST=gemm.expand_first and lora_b is not None and delta is None,
        TAIL_VARIANTS=tail_variants(gemm.half_tail, aligned.block_m),
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
        ONE_DOT=gemm.expand_one_dot and lora_b is not None and delta is None,
        **fp8_scale_args(w_scale, scale_block, block_k, dummy),
        **quantized_input_args("z", z, z_quant, fp8, w_scale, scale_block),
    )
    return grid, kw, out


# expert_down has expert_down_launch's parameters and docstring (help() and inspect show them)
functools.update_wrapper(expert_down, expert_down_launch, assigned=("__doc__",), updated=())
