"""LoRA shrink: inter[p, s, :] = A[slot, expert, s] @ in_row(p), fp32, over aligned blocks.

The rank-R intermediate stays in fp32 (a bf16 intermediate measurably hurt accuracy in
other engines). Rows of a block are sorted by slot, so each program loops over the few
distinct slots present and reads each (slot, expert) A matrix once per block.

Split-K (split > 1): program (block, part, k_split) covers one K chunk and atomically adds
its fp32 partial into a zeroed intermediate. With few blocks (small T) one program per
block streams whole (slot, expert) A matrices serially with too few loads in flight to
use the memory bandwidth; splitting K multiplies the programs (KERNEL_LOG.md v6).

Legend: P pairs, S parts (2 gated w13, 1 otherwise), R max rank, L slots, E experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .align import AlignedPairs
from .checks import check_dtype_match, check_shape, precision_flags
from .tiles import block_rows, mma


@triton.jit
def _lora_shrink_kernel(
    in_ptr,
    a_ptr,
    slots_ptr,
    inter_ptr,
    sorted_pair_ids_ptr,
    block_experts_ptr,
    num_padded_ptr,
    num_pairs,
    top_k,
    row_div,
    num_slots,
    rank,
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
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    part = tl.program_id(1)
    k_start = tl.program_id(2) * k_chunk
    k_end = tl.minimum(k_start + k_chunk, k_dim)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    pair, _, slot = block_rows(
        sorted_pair_ids_ptr, slots_ptr, pid_m, num_pairs, top_k, num_slots, BLOCK_M, True
    )
    row = pair // row_div
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + expert.to(tl.int64) * stride_ae + part * stride_as
    lo = tl.min(tl.where(slot >= 0, slot, num_slots), axis=0)
    hi = tl.max(slot, axis=0)
    for a in range(lo, hi + 1):
        rows = slot == a
        if tl.max(rows.to(tl.int32), axis=0) > 0:
            # int64 slot offset: L*E*S*R*H exceeds 2**31 (DeepSeek-V3, R=128). expert*0
            # makes an int64 scalar both compiled and interpreted (where `a` is a Python int).
            a_off = (expert.to(tl.int64) * 0 + a) * stride_al
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(k_start, k_end, BLOCK_K):
                k_mask = (k0 + offs_k) < k_end
                xin = tl.load(
                    in_ptr
                    + row[:, None].to(tl.int64) * stride_im
                    + (k0 + offs_k)[None, :] * stride_ik,
                    mask=rows[:, None] & k_mask[None, :],
                    other=0.0,
                )
                w = tl.load(
                    a_base
                    + a_off
                    + offs_r[None, :] * stride_ar
                    + (k0 + offs_k)[:, None] * stride_ak,
                    mask=r_mask[None, :] & k_mask[:, None],
                    other=0.0,
                )
                if UPCAST:
                    xin = xin.to(tl.float32)
                    w = w.to(tl.float32)
                acc = mma(xin, w, acc, IEEE)
            o_ptrs = (
                inter_ptr
                + pair[:, None].to(tl.int64) * stride_om
                + part * stride_os
                + offs_r[None, :] * stride_or
            )
            o_mask = rows[:, None] & r_mask[None, :]
            if SPLIT:
                tl.atomic_add(o_ptrs, acc, mask=o_mask, sem="relaxed")  # a reduction
            else:
                tl.store(o_ptrs, acc, mask=o_mask)


def lora_shrink(
    inp: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    aligned: AlignedPairs,
    *,
    top_k: int,
    rows_are_tokens: bool,
    block_k: int,
    split_k: int = 1,
    num_warps: int = 4,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """inp: x [T, H] (rows_are_tokens) or z [P, I]; lora_a [L, E, S, R, in] (w13) or
    [L, E, R, in] (w2, S = 1). Returns inter [P, S, R] fp32; rows of slot -1 unwritten
    (zero when split_k > 1: the intermediate is zeroed for the atomic adds)."""
    a5 = lora_a if lora_a.dim() == 5 else lora_a.unsqueeze(2)
    num_slots, _, parts, rank, k_dim = a5.shape
    check_shape("lora A", a5, (None, None, parts, rank, inp.shape[1]))
    check_dtype_match("lora A", a5, inp)
    num_pairs = token_slots.shape[0] * top_k
    rows = token_slots.shape[0] if rows_are_tokens else num_pairs
    check_shape("LoRA shrink input", inp, (rows, k_dim))
    # K chunks of whole BLOCK_K tiles; chunks past the end leave their programs idle.
    k_chunk = triton.cdiv(triton.cdiv(k_dim, max(1, split_k)), block_k) * block_k
    split = triton.cdiv(k_dim, k_chunk)
    if out is None:
        alloc = torch.zeros if split > 1 else torch.empty
        out = alloc(num_pairs, parts, rank, dtype=torch.float32, device=inp.device)
    elif split > 1:
        out.zero_()
    a_in, o_in = a5, out
    if _parts_fuse(a5, out):
        # Gate and up rows of A are one [S*R, in] matrix: one program computes both parts
        # from one read of the input rows (the per-part grid read x twice).
        a_in = a5.view(num_slots, a5.shape[1], 1, parts * rank, k_dim)
        o_in = out.view(num_pairs, 1, parts * rank)
    _launch(
        inp, a_in, token_slots, aligned, o_in, top_k, rows_are_tokens, block_k, k_chunk, num_warps
    )
    return out


def _parts_fuse(a5: torch.Tensor, out: torch.Tensor) -> bool:
    """Parts fuse when (S, R) is one contiguous run in A and out, and S*R rank lanes stay
    within 64 fp32 registers per row (rank 16 gated = 32 lanes)."""
    _, _, parts, rank, _ = a5.shape
    return (
        parts > 1
        and triton.next_power_of_2(parts * rank) <= 64
        and a5.stride(2) == rank * a5.stride(3)
        and out.stride(1) == rank * out.stride(2)
    )


def _launch(
    inp, a5, token_slots, aligned, out, top_k, rows_are_tokens, block_k, k_chunk, num_warps
):
    num_slots, _, parts, rank, k_dim = a5.shape
    split = triton.cdiv(k_dim, k_chunk)
    num_pairs = out.shape[0]
    block_r = max(16, triton.next_power_of_2(rank))
    upcast, ieee = precision_flags(inp)
    _lora_shrink_kernel[(aligned.num_blocks, parts, split)](
        in_ptr=inp,
        a_ptr=a5,
        slots_ptr=token_slots,
        inter_ptr=out,
        sorted_pair_ids_ptr=aligned.sorted_pair_ids,
        block_experts_ptr=aligned.block_experts,
        num_padded_ptr=aligned.num_padded,
        num_pairs=num_pairs,
        top_k=top_k,
        row_div=top_k if rows_are_tokens else 1,
        num_slots=num_slots,
        rank=rank,
        k_dim=k_dim,
        k_chunk=k_chunk,
        stride_im=inp.stride(0),
        stride_ik=inp.stride(1),
        stride_al=a5.stride(0),
        stride_ae=a5.stride(1),
        stride_as=a5.stride(2),
        stride_ar=a5.stride(3),
        stride_ak=a5.stride(4),
        stride_om=out.stride(0),
        stride_os=out.stride(1),
        stride_or=out.stride(2),
        BLOCK_M=aligned.block_m,
        BLOCK_K=block_k,
        BLOCK_R=block_r,
        SPLIT=split > 1,
        UPCAST=upcast,
        IEEE=ieee,
        num_warps=num_warps,
    )
