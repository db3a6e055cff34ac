"""LoRA expand over the shrink tiles: delta[p, s, :] = inter[p, s, :R] @ B[slot, expert, s]^T,
written in the activation dtype for the GEMM epilogues to add (TileConfig.lora_delta).

Why: at mid T an aligned block holds every adapter (T = 1024 on Qwen3-30B-A3B: ~8 pairs of
each of 8 slots in a block of 128 rows), so the in-GEMM expand multiplies every row by
every slot's B (rank lanes x slots, hi/lo split: +33% MMA work in the down GEMM at R = 16)
after the main loop, with its loads exposed. The shrink tiles are runs of one (expert,
slot) bucket, so here each row meets only its own B: one [BLOCK_M, R] x [R, BLOCK_N] dot
pair (hi/lo, keeping the fp32 intermediate's precision) per tile and N tile. The price is
the delta's write and read (P * S * N elements in x's dtype, transient: P * (2I + H)
elements for a gated layer, 3 GB for DeepSeek-V3 at T = 16384), so it pays where the mixed
blocks cost more than that traffic (the tune decides per row; on the H200 only T = 1024).
The delta is rounded once to x's dtype before the GEMM adds it (one more rounding than
the in-GEMM expand; measured in fp16 5-6e-4 relative error against 4e-4).

Rows of pairs without an adapter are not written (the GEMMs mask them by slot).

Legend: P pairs, S parts (2 gated up, 1 down), N output columns (I or H), R rank.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import InputError
from ..tiling.geometry import rank_block
from .align import AlignedPairs
from .checks import check_shape, precision_flags, workspace
from .launch_args import lora_tile_args, strides, with_parts
from .output import as_stored
from .pdl import chain_point
from .ranks import slot_ranks
from .tiles import RANK_STEP, expand_dot, lora_tile

BLOCK_N = 128  # 256-byte bf16 row pieces per store; reasoned, not tuned
DELTA_BLOCK_R = 32  # rank lanes per expand step, up to the slot's rank; reasoned, not tuned


@triton.jit
def expand_tile(
    t,
    b_ptr,
    lane_r,
    lane_ok,
    offs_n,
    n_ok,
    delta_ptr,
    pair,
    row_ok,
    stride_bn,
    stride_br,
    stride_dm,
    stride_dn,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    ONE_DOT: tl.constexpr,
):
    """delta rows [BLOCK_M, BLOCK_N] = t (fp32 [BLOCK_M, lanes]) @ B lanes, stored in the
    delta's dtype: B rows lane_r of one (slot, expert, part) at b_ptr (lanes not lane_ok
    load zeros), delta_ptr at that part. Shared by the delta kernel and the expanding
    shrink."""
    b = tl.load(
        b_ptr + offs_n[None, :] * stride_bn + lane_r[:, None] * stride_br,
        mask=lane_ok[:, None] & n_ok[None, :],
        other=0.0,
    )
    d = tl.zeros((t.shape[0], offs_n.shape[0]), dtype=tl.float32)
    d = expand_dot(t, b, d, UPCAST, IEEE, ONE_DOT)
    d_ptrs = delta_ptr + pair[:, None].to(tl.int64) * stride_dm + offs_n[None, :] * stride_dn
    tl.store(d_ptrs, as_stored(d, delta_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _lora_delta_kernel(
    inter_ptr,
    b_ptr,
    delta_ptr,
    tiles,
    ranks_ptr,
    max_rank,
    n_size,
    stride_im,
    stride_is,
    stride_ir,
    stride_bl,
    stride_be,
    stride_bs,
    stride_bn,
    stride_br,
    stride_dm,
    stride_ds,
    stride_dn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
    ONE_DOT: tl.constexpr = False,  # one 16-bit dot per step (tiles.expand_dot)
):
    chain_point(PDL)  # nothing is read before the wait (kernels/pdl.py)
    tile = tl.program_id(0)
    if tile >= tl.load(tiles.num_tiles_ptr):
        return
    offs_m, row_ok, expert, slot = lora_tile(tiles.tiles_ptr, tile, BLOCK_M)
    if (expert < 0) | (slot < 0):
        return
    part = tl.program_id(1)
    pair = tl.load(tiles.sorted_pair_ids_ptr + offs_m, mask=row_ok, other=0).to(tl.int64)
    # the slot's width (real rank rounded up to RANK_STEP: the intermediate is zero past the
    # rank, B finite; cut to R = max_rank), BLOCK_R lanes per step
    rank = tl.load(ranks_ptr + slot)
    rank = tl.minimum((rank + RANK_STEP - 1) // RANK_STEP * RANK_STEP, max_rank)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_size
    b_part = b_ptr + slot.to(tl.int64) * stride_bl + expert.to(tl.int64) * stride_be
    b_part += part * stride_bs
    d = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_ok = offs_r < rank
        t = tl.load(
            inter_ptr + pair[:, None] * stride_im + part * stride_is + offs_r[None, :] * stride_ir,
            mask=row_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_part + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
            mask=r_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        d = expand_dot(t, b, d, UPCAST, IEEE, ONE_DOT)
    d_ptrs = delta_ptr + part * stride_ds + pair[:, None] * stride_dm + offs_n[None, :] * stride_dn
    tl.store(d_ptrs, as_stored(d, delta_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def lora_delta(
    inter: torch.Tensor,
    lora_b: torch.Tensor,
    aligned: AlignedPairs,
    *,
    dtype: torch.dtype,
    ranks: torch.Tensor | None = None,
    pdl: bool = False,
    one_dot: bool = False,
) -> torch.Tensor:
    """inter [P, S, R] fp32 (lora_shrink), lora_b [L, E, S, N, R] (w13_b) or [L, E, N, R]
    (w2_b, S = 1), aligned with its LoRA tiles; ranks [L] int32 (LoRABank.ranks; None: every
    slot at R): a slot's expand stops at its real rank. one_dot (16-bit): the intermediate
    rounded to `dtype`, one dot per step (tiles.expand_dot). Returns delta [P, S, N] in `dtype`,
    rows of pairs without an adapter unwritten."""
    b5 = with_parts(lora_b)
    _, _, parts, n_size, rank = b5.shape
    num_pairs = inter.shape[0]
    check_shape("LoRA intermediate", inter, (num_pairs, parts, rank))
    if b5.dtype != dtype:
        raise InputError("lora B", f"dtype {b5.dtype}", f"{dtype} (the dtype of x); cast it")
    delta = workspace(num_pairs, parts, n_size, dtype=dtype, device=inter.device)
    upcast, ieee = precision_flags(delta)
    grid = (aligned.max_lora_tiles, parts, triton.cdiv(n_size, BLOCK_N))
    _lora_delta_kernel[grid](
        inter_ptr=inter,
        b_ptr=b5,
        delta_ptr=delta,
        **lora_tile_args(aligned),
        ranks_ptr=slot_ranks(b5, ranks, 4),
        max_rank=rank,
        n_size=n_size,
        **strides("i", inter, "msr"),
        **strides("b", b5, "lesnr"),
        **strides("d", delta, "msn"),
        BLOCK_N=BLOCK_N,
        BLOCK_R=min(DELTA_BLOCK_R, rank_block(rank)),
        UPCAST=upcast,
        IEEE=ieee,
        PDL=pdl,
        launch_pdl=pdl,
        ONE_DOT=one_dot,
    )
    return delta
