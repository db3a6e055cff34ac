"""Decode-path LoRA shrink of x: inter[p, s, r] = A[slot, expert, s, r] . x[token(p)], fp32,
straight from the top-k ids (no alignment), and the z-shrink accumulator zeroed.

At a handful of tokens the shrink is a GEMV over P*S*R rows of H (8 pairs x 2 parts x
rank 16 = 256 rows of 2048 at T = 1): one program per ROWS_PER_PROG such rows, each read
in as few wide loads as the registers allow, so the whole A traffic is in flight at once
(a program per (pair, part) streaming its [R, H] matrix in K steps waited on HBM once per
step). The decode up kernel adds the z shrink into z_inter with atomics, so its rows are
zeroed here, one launch before.

Rows of pairs with slot -1, a slot >= L or an expert outside [0, E), and columns past a
slot's real rank, get zeros.

Legend: T tokens, K top-k, P = T*K pairs, S parts (2 gated), R max rank, H hidden.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tiling.geometry import rank_block
from .checks import check_dtype_match, check_shape, workspace
from .launch_args import strides
from .pdl import chain_point
from .ranks import slot_ranks


@triton.jit
def _decode_shrink_kernel(
    x_ptr,
    a_ptr,
    topk_ids_ptr,
    slots_ptr,
    inter_ptr,
    z_inter_ptr,
    num_rows,
    top_k,
    num_experts,
    num_slots,
    parts,
    rank,
    ranks_ptr,
    rank_offset,
    hidden,
    stride_xm,
    stride_xk,
    stride_al,
    stride_ae,
    stride_as,
    stride_ar,
    stride_ak,
    stride_im,
    stride_is,
    stride_ir,
    z_size,
    z_per_prog,
    BLOCK_R: tl.constexpr,
    ROWS_PER_PROG: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ZERO_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    chain_point(PDL)  # the layer's first kernel: lets the up kernel start early (pdl.py)
    offs_q = tl.program_id(0) * ROWS_PER_PROG + tl.arange(0, ROWS_PER_PROG)
    q_ok = offs_q < num_rows
    # row q = (pair, part, r) with r over BLOCK_R (rank padded); rows r >= rank are zeros
    pair = offs_q // (parts * BLOCK_R)
    part = (offs_q // BLOCK_R) % parts
    r = offs_q % BLOCK_R
    pair = tl.where(q_ok, pair, 0)
    token = pair // top_k
    expert = tl.load(topk_ids_ptr + pair, mask=q_ok, other=-1)
    slot = tl.load(slots_ptr + token, mask=q_ok, other=-1)
    live = q_ok & (expert >= 0) & (expert < num_experts) & (slot >= 0) & (slot < num_slots)
    # the slot's real rank, in this A's columns (a rank shard from rank_offset: fully sharded)
    live = live & (r + rank_offset < tl.load(ranks_ptr + slot, mask=live, other=0))
    a_row = (
        a_ptr
        + tl.where(live, slot, 0).to(tl.int64) * stride_al
        + tl.where(live, expert, 0).to(tl.int64) * stride_ae
        + part * stride_as
        + tl.where(live, r, 0) * stride_ar
    )
    x_row = x_ptr + token.to(tl.int64) * stride_xm
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((ROWS_PER_PROG,), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = (k0 + offs_k) < hidden
        mask = live[:, None] & k_ok[None, :]
        a = tl.load(a_row[:, None] + (k0 + offs_k)[None, :] * stride_ak, mask=mask, other=0.0)
        xv = tl.load(x_row[:, None] + (k0 + offs_k)[None, :] * stride_xk, mask=mask, other=0.0)
        acc += tl.sum(a.to(tl.float32) * xv.to(tl.float32), axis=1)
    i_ptrs = inter_ptr + pair.to(tl.int64) * stride_im + part * stride_is + r * stride_ir
    tl.store(i_ptrs, acc, mask=q_ok & (r < rank))
    # this program's share of the (contiguous) z-shrink accumulator
    z_start = tl.program_id(0) * z_per_prog
    offs_z = tl.arange(0, ZERO_BLOCK)
    for z0 in range(z_start, z_start + z_per_prog, ZERO_BLOCK):
        z_ok = (z0 + offs_z < z_start + z_per_prog) & (z0 + offs_z < z_size)
        tl.store(z_inter_ptr + z0 + offs_z, tl.zeros((ZERO_BLOCK,), tl.float32), mask=z_ok)


def decode_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    topk_ids: torch.Tensor,
    token_slots: torch.Tensor,
    num_experts: int,
    z_rank: int,
    *,
    rows_per_prog: int = 2,
    block_k: int = 1024,
    num_warps: int = 4,
    ranks: torch.Tensor | None = None,
    rank_offset: int = 0,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], lora_a (w13_a) [L, E, S, R, H], topk_ids [T, K], token_slots [T] int32 ->
    (inter [P, S, R] fp32, z_inter [P, z_rank] fp32 zeros: the down A's rank, which under
    fully sharded LoRA is the whole R while lora_a holds an R/tp shard). ranks [L] int32
    (LoRABank.ranks; None: every slot at R): columns past a slot's real rank are zeros;
    rank_offset: lora_a holds the rank columns from there on (a fully sharded shard).

    Defaults (rows_per_prog 2, block_k 1024): a program loads 2 rows x 1024 columns (4 KB
    in bf16) per step, so at T = 1 (256 rows) the 128 programs put every A row in flight in
    two steps; chosen by that arithmetic, the decode tune may override them."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_slots, _, parts, rank, _ = lora_a.shape
    check_shape("lora w13_a", lora_a, (None, num_experts, parts, rank, hidden))
    check_dtype_match("lora w13_a", lora_a, x)
    num_pairs = num_tokens * top_k
    block_r = rank_block(rank)
    inter = workspace(num_pairs, parts, rank, dtype=torch.float32, device=x.device)
    z_inter = workspace(num_pairs, z_rank, dtype=torch.float32, device=x.device)
    num_rows = num_pairs * parts * block_r
    block_k = min(block_k, triton.next_power_of_2(hidden))
    grid = (triton.cdiv(num_rows, rows_per_prog),)
    z_per_prog = triton.cdiv(z_inter.numel(), grid[0])
    _decode_shrink_kernel[grid](
        x_ptr=x,
        a_ptr=lora_a,
        topk_ids_ptr=topk_ids,
        slots_ptr=token_slots,
        inter_ptr=inter,
        z_inter_ptr=z_inter,
        num_rows=num_rows,
        top_k=top_k,
        num_experts=num_experts,
        num_slots=num_slots,
        parts=parts,
        rank=rank,
        ranks_ptr=slot_ranks(lora_a, ranks, 3),
        rank_offset=rank_offset,
        hidden=hidden,
        **strides("x", x, "mk"),
        **strides("a", lora_a, "lesrk"),
        **strides("i", inter, "msr"),
        z_size=z_inter.numel(),
        z_per_prog=z_per_prog,
        BLOCK_R=block_r,
        ROWS_PER_PROG=rows_per_prog,
        BLOCK_K=block_k,
        ZERO_BLOCK=max(16, min(1024, triton.next_power_of_2(z_per_prog))),
        PDL=pdl,
        num_warps=num_warps,
    )
    return inter, z_inter
