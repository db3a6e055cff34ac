"""LoRA shrink: inter[p, s, :] = A[slot, expert, s] @ in_row(p), fp32, over the shrink tiles.

The rank-R intermediate stays in fp32 (a bf16 intermediate measurably hurt accuracy in
other engines). The work list is the alignment's LoRA tiles: runs of at most TILE_M
consecutive sorted pairs that share one expert and one slot, so a program reads one
(slot, expert) A matrix in one pipelined K loop over its rows, and pairs of slot -1 cost
nothing. (v6 and before looped over the slots of each aligned block with one K loop per
slot: serial, and its x tile re-gathered per slot; docs/history/kernel_log.md v7.)

A program computes PARTS_PER_PROG parts at once (gate and up from one read of the input
rows when their S*R lanes fit), the others go to grid dimension 1.

Split-K (split > 1): program (tile, part group, k_split) covers one K chunk and atomically
adds its fp32 partial into a zeroed intermediate: with few tiles (small T) each program
streams a whole A matrix serially with too few loads in flight for HBM; splitting K
multiplies the programs (docs/history/kernel_log.md v6).

Legend: P pairs, S parts (2 gated w13, 1 otherwise), R max rank, L slots, E experts.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..errors import InputError
from ..tiling.geometry import (
    EXPAND_BLOCK_N,
    SHRINK_STAGES,
    shrink_parts_per_program,
    shrink_rank_block,
)
from .align import AlignedPairs
from .checks import check_dtype_match, check_shape, precision_flags, workspace
from .launch_args import lora_tile_args, strides, with_parts
from .lora_delta import expand_tile
from .pdl import chain_point
from .ranks import slot_ranks
from .tiles import RANK_STEP, lora_tile, max_width, mma


@triton.jit
def _expand_rows(
    pid_q,
    acc,
    q_part,
    q_r,
    q_ok,
    pair,
    row_ok,
    b_ptr,
    delta_ptr,
    n_size,
    parts,
    stride_bs,
    stride_bn,
    stride_br,
    stride_dm,
    stride_ds,
    stride_dn,
    PARTS_PER_PROG: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    ONE_DOT: tl.constexpr,
):
    """delta[pair, part, :] = acc's lanes of that part @ B[part]^T, for each part of the
    program, BLOCK_N columns at a time (lora_delta's product, from registers). b_ptr is at
    (slot, expert, part 0); pid_q: the program's grid dimension 1. Lanes of the other parts
    meet zero B rows."""
    for i in tl.static_range(PARTS_PER_PROG):
        part = pid_q * PARTS_PER_PROG + i
        lanes = q_ok & (q_part == part)
        # this part's lanes only: another part's intermediate must not reach the 16-bit
        # split (an fp16 overflow there would give inf * 0 = NaN in this part's delta)
        t = tl.where(lanes[None, :], acc, 0.0)
        n_end = tl.where(part < parts, n_size, 0)  # a part past the last one writes nothing
        for n0 in range(0, n_size, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            expand_tile(
                t,
                b_ptr + part * stride_bs,
                q_r,
                lanes,
                offs_n,
                offs_n < n_end,
                delta_ptr + part * stride_ds,
                pair,
                row_ok,
                stride_bn,
                stride_br,
                stride_dm,
                stride_dn,
                UPCAST,
                IEEE,
                ONE_DOT,
            )


@triton.jit
def _lora_shrink_kernel(
    in_ptr,
    a_ptr,
    inter_ptr,
    tiles,
    row_div,
    parts,
    part_groups,
    ranks_ptr,
    rank_offset,
    r_size,
    num_slots,
    k_dim,
    k_chunk,
    stride_im,
    stride_ik,
    stride_al,
    stride_ae,
    stride_as,
    stride_ar,
    stride_ak,
    stride_om,
    stride_os,
    stride_or,
    b_ptr,
    delta_ptr,
    n_size,
    stride_bl,
    stride_be,
    stride_bs,
    stride_bn,
    stride_br,
    stride_dm,
    stride_ds,
    stride_dn,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PARTS_PER_PROG: tl.constexpr,
    BLOCK_L: tl.constexpr,
    FILL_BLOCK: tl.constexpr,
    SPLIT: tl.constexpr,
    ROWS_SORTED: tl.constexpr,
    EXPAND: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
    ONE_DOT: tl.constexpr = False,  # EXPAND: one 16-bit dot per N tile (tiles.expand_dot)
):
    chain_point(PDL)  # nothing is read before the wait (kernels/pdl.py)
    # program (LoRA tile, grid dimension 1: rank chunk and part group, K chunk)
    tile, pid_q, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if tile >= tl.load(tiles.num_tiles_ptr):
        return
    offs_m, row_ok, expert, slot = lora_tile(tiles.tiles_ptr, tile, BLOCK_M)
    if (expert < 0) | (slot < 0):
        return
    k_start = pid_k * k_chunk
    k_end = tl.minimum(k_start + k_chunk, k_dim)
    # grid dimension 1: (rank chunk, part group). In this A's columns (a rank shard from
    # rank_offset under fully sharded LoRA): [0, rank) are the slot's, [rank, width) are
    # written as zeros, and a chunk past the width is idle. The width: the real rank
    # rounded up to RANK_STEP (what the decode and delta expands read), or with FILL_BLOCK
    # the widest slot's rounded up to FILL_BLOCK (what the in-GEMM expand's passes read).
    r0 = (pid_q // part_groups) * BLOCK_R
    real = tl.load(ranks_ptr + slot)
    rank = real - rank_offset
    width = (real + RANK_STEP - 1) // RANK_STEP * RANK_STEP
    if FILL_BLOCK > 0:
        width = tl.cdiv(max_width(ranks_ptr, num_slots, BLOCK_L), FILL_BLOCK) * FILL_BLOCK
    width = tl.minimum(width - rank_offset, r_size)
    if r0 >= width:
        return
    if r0 >= rank:  # zeros only: no K steps
        k_end = k_start
    pair = tl.load(tiles.sorted_pair_ids_ptr + offs_m, mask=row_ok, other=0)
    if ROWS_SORTED:  # input rows in the sorted order (z of a z_sorted up GEMM)
        row = offs_m.to(tl.int64)
    else:
        row = (pair // row_div).to(tl.int64)
    # lanes: (part, r) of the parts this program covers
    offs_q = tl.arange(0, PARTS_PER_PROG * BLOCK_R)
    q_part = (pid_q % part_groups) * PARTS_PER_PROG + offs_q // BLOCK_R
    q_r = r0 + offs_q % BLOCK_R
    q_ok = (q_r < rank) & (q_part < parts)  # lanes read from A
    q_st = (q_r < width) & (q_part < parts)  # lanes written (zeros past the rank)
    q_off = q_part * stride_as + q_r * stride_ar
    # int64: L*E*S*R*H exceeds 2**31 (DeepSeek-V3, R=128)
    a_base = a_ptr + slot.to(tl.int64) * stride_al + expert.to(tl.int64) * stride_ae
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, PARTS_PER_PROG * BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = (k0 + offs_k) < k_end
        xin = tl.load(
            in_ptr + row[:, None] * stride_im + (k0 + offs_k)[None, :] * stride_ik,
            mask=row_ok[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            a_base + q_off[None, :] + (k0 + offs_k)[:, None] * stride_ak,
            mask=q_ok[None, :] & k_mask[:, None],
            other=0.0,
        )
        if UPCAST:
            xin = xin.to(tl.float32)
            w = w.to(tl.float32)
        acc = mma(xin, w, acc, IEEE)
    if EXPAND:  # the delta rows straight from the whole-K intermediate (no split)
        _expand_rows(
            pid_q,
            acc,
            q_part,
            q_r,
            q_st,
            pair,
            row_ok,
            b_ptr + slot.to(tl.int64) * stride_bl + expert.to(tl.int64) * stride_be,
            delta_ptr,
            n_size,
            parts,
            stride_bs,
            stride_bn,
            stride_br,
            stride_dm,
            stride_ds,
            stride_dn,
            PARTS_PER_PROG,
            BLOCK_N,
            UPCAST,
            IEEE,
            ONE_DOT,
        )
    else:
        o_ptrs = (
            inter_ptr
            + pair[:, None].to(tl.int64) * stride_om
            + (q_part * stride_os + q_r * stride_or)[None, :]
        )
        o_mask = row_ok[:, None] & q_st[None, :]
        if SPLIT:
            tl.atomic_add(o_ptrs, acc, mask=o_mask, sem="relaxed")  # a reduction
        else:
            tl.store(o_ptrs, acc, mask=o_mask)


def lora_shrink(*args, **kwargs) -> torch.Tensor:
    """Launches the LoRA shrink (arguments and result: lora_shrink_launch)."""
    grid, kw, out = lora_shrink_launch(*args, **kwargs)
    _lora_shrink_kernel[grid](**kw)
    return out


def lora_shrink_launch(
    inp: torch.Tensor,
    lora_a: torch.Tensor,
    aligned: AlignedPairs,
    *,
    num_pairs: int,
    rows: str,
    top_k: int,
    block_k: int,
    split_k: int = 1,
    num_warps: int = 4,
    num_stages: int = SHRINK_STAGES,
    out: torch.Tensor | None = None,
    expand_b: torch.Tensor | None = None,
    ranks: torch.Tensor | None = None,
    rank_offset: int = 0,
    tile_rank: int | None = None,
    fill_block: int = 0,
    pdl: bool = False,
    one_dot: bool = False,
) -> tuple[tuple[int, int, int], dict, torch.Tensor]:
    """(grid, the kernel's keyword arguments, the result) of a LoRA shrink launch, checked
    and allocated; lora_shrink launches it.

    inp: x [T, H] (rows "tokens"), z [P, I] (rows "pairs") or z [P_pad, I] in the sorted
    order (rows "sorted"); lora_a [L, E, S, R, in] (w13) or
    [L, E, R, in] (w2, S = 1); aligned: with its LoRA tiles (align_pairs(lora_tile_m=...)).
    Returns inter [P, S, R] fp32; rows of slot -1 unwritten (zero when split_k > 1: the
    intermediate is zeroed for the atomic adds).

    expand_b (lora_b: w13_b [L, E, S, N, R] or w2_b [L, E, N, R]): the expand follows in the
    same program (lora_delta's product, the intermediate never stored; split_k ignored, a
    whole-K intermediate is needed) and the result is the delta [P, S, N] in inp's dtype,
    rows of pairs without an adapter unwritten; one_dot (16-bit): that expand's intermediate
    rounded to inp's dtype, one dot per N tile (tiles.expand_dot).

    ranks [L] int32 (LoRABank.ranks; None: every slot at R): a slot's programs stop at its
    real rank r; the intermediate's columns [r, width) of its rows are written as zeros
    (width: r rounded up to RANK_STEP, what the delta and decode expands read), those past
    the width left unwritten (zero with split-K). rank_offset: lora_a holds the rank columns from there
    on (fully sharded LoRA's shard). tile_rank: the rank the chunks are sized for (None: R).
    fill_block > 0: every row's zeros go on up to the widest slot's width rounded up to
    it (the in-GEMM expand's BLOCK_R: its passes read that far for every slot)."""
    if aligned.lora_tiles is None:
        raise InputError(
            "aligned", "pairs aligned without LoRA tiles", "align_pairs(..., lora_tile_m > 0)"
        )
    a5 = with_parts(lora_a)
    _, _, parts, rank, k_dim = a5.shape
    check_shape("lora A", a5, (None, None, parts, rank, inp.shape[1]))
    check_dtype_match("lora A", a5, inp)
    want_rows = {
        "tokens": num_pairs // top_k,
        "pairs": num_pairs,
        "sorted": aligned.sorted_pair_ids.shape[0],
    }
    if rows not in want_rows:
        raise InputError("rows", repr(rows), "'tokens', 'pairs' or 'sorted'")
    check_shape("LoRA shrink input", inp, (want_rows[rows], k_dim))
    b5 = None
    if expand_b is not None and out is not None:
        raise InputError(
            "out", "given with expand_b", "out=None (the expanded delta is a new tensor)"
        )
    if expand_b is not None:
        b5 = with_parts(expand_b)
        check_shape("lora B", b5, (a5.shape[0], a5.shape[1], parts, None, rank))
        check_dtype_match("lora B", b5, inp)
        split_k = 1
    # K chunks of whole BLOCK_K tiles; chunks past the end leave their programs idle.
    k_chunk = triton.cdiv(triton.cdiv(k_dim, max(1, split_k)), block_k) * block_k
    split = triton.cdiv(k_dim, k_chunk)
    delta = None
    if b5 is not None:
        delta = workspace(num_pairs, parts, b5.shape[3], dtype=inp.dtype, device=inp.device)
        out = delta  # never written as an intermediate: EXPAND stores the delta instead
    elif out is None:
        alloc = torch.zeros if split > 1 else workspace
        out = alloc(num_pairs, parts, rank, dtype=torch.float32, device=inp.device)
    elif split > 1:
        out.zero_()
    ranks = slot_ranks(a5, ranks, 3)
    key = rank if tile_rank is None else min(rank, max(1, tile_rank))
    block_r = shrink_rank_block(parts, rank if b5 is not None else key, whole=b5 is not None)
    per_prog = shrink_parts_per_program(parts, block_r)
    part_groups = triton.cdiv(parts, per_prog)
    upcast, ieee = precision_flags(inp)
    grid = (aligned.max_lora_tiles, part_groups * triton.cdiv(rank, block_r), split)
    kw = dict(
        in_ptr=inp,
        a_ptr=a5,
        inter_ptr=out,
        **lora_tile_args(aligned),
        row_div=top_k if rows == "tokens" else 1,
        parts=parts,
        part_groups=part_groups,
        ranks_ptr=ranks,
        rank_offset=rank_offset,
        r_size=rank,
        num_slots=a5.shape[0],
        k_dim=k_dim,
        k_chunk=k_chunk,
        **strides("i", inp, "mk"),
        **strides("a", a5, "lesrk"),
        **strides("o", out, "msr"),
        b_ptr=b5 if b5 is not None else a5,
        delta_ptr=delta if delta is not None else out,
        n_size=b5.shape[3] if b5 is not None else 0,
        **strides("b", b5, "lesnr"),
        **strides("d", delta, "msn"),
        BLOCK_K=block_k,
        BLOCK_R=block_r,
        PARTS_PER_PROG=per_prog,
        BLOCK_L=triton.next_power_of_2(max(1, a5.shape[0])),
        FILL_BLOCK=fill_block,
        SPLIT=split > 1,
        ROWS_SORTED=rows == "sorted",
        EXPAND=b5 is not None,
        BLOCK_N=EXPAND_BLOCK_N,
        UPCAST=upcast,
        IEEE=ieee,
        num_warps=num_warps,
        num_stages=num_stages,
        PDL=pdl,
        launch_pdl=pdl,
        ONE_DOT=one_dot and b5 is not None,
    )
    return grid, kw, out


# lora_shrink has lora_shrink_launch's parameters and docstring (help() and inspect show them)
functools.update_wrapper(lora_shrink, lora_shrink_launch, assigned=("__doc__",), updated=())
