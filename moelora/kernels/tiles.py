"""Device helpers shared by the expert GEMM kernels: program ordering, block rows, dots,
and the per-slot LoRA expand. Pure tile arithmetic; no policy."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering (Triton matmul tutorial): GROUP_M row blocks share each weight tile
    while it is in L2. Blocks of one expert are adjacent, so they also share the expert."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def block_rows(
    sorted_pair_ids_ptr,
    slots_ptr,
    pid_m,
    num_pairs,
    top_k,
    num_slots,
    BLOCK_M: tl.constexpr,
    HAS_LORA: tl.constexpr,
):
    """pair [BLOCK_M] (sentinel num_pairs on padding rows), row_valid, slot (-1 = no adapter)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + offs_m)
    row_valid = pair < num_pairs
    pair = tl.where(row_valid, pair, 0)  # safe address for padding rows; results masked
    if HAS_LORA:
        slot = tl.load(slots_ptr + pair // top_k, mask=row_valid, other=-1)
        slot = tl.where(row_valid & (slot >= 0) & (slot < num_slots), slot, -1)
    else:
        slot = tl.full([BLOCK_M], -1, tl.int32)
    return pair, row_valid, slot


@triton.jit
def mma(a, b, acc, IEEE: tl.constexpr):
    """acc += a @ b; IEEE keeps fp32 operands exact (no tf32) for fp32 inputs."""
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def lora_expand(
    acc,
    inter_ptr,
    stride_im,
    stride_ir,
    pair,
    slot,
    num_slots,
    b_ptr,
    stride_bl,
    stride_bn,
    stride_br,
    offs_n,
    n_mask,
    rank,
    zero64,
    BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """acc [BLOCK_M, BLOCK_N] += per row: inter[pair] (fp32 [R]) @ B[slot]^T.

    inter_ptr is already offset to this GEMM part; b_ptr to (expert, part); slot stride
    stride_bl. Rows are sorted by slot inside an expert, so the loop runs over the few
    distinct slots of the block; absent slots are skipped. 16-bit B: the fp32 intermediate
    is split into a high and a low 16-bit part, so two native dots keep ~16 mantissa bits.
    """
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    has = slot >= 0
    tmp = tl.load(
        inter_ptr + pair[:, None] * stride_im + offs_r[None, :] * stride_ir,
        mask=has[:, None] & r_mask[None, :],
        other=0.0,
    )
    lo = tl.min(tl.where(has, slot, num_slots), axis=0)
    hi = tl.max(slot, axis=0)
    for a in range(lo, hi + 1):
        rows = slot == a
        if tl.max(rows.to(tl.int32), axis=0) > 0:
            t = tl.where(rows[:, None], tmp, 0.0)
            b = tl.load(
                b_ptr
                + (zero64 + a) * stride_bl  # int64: L*E*... can exceed 2**31
                + offs_n[None, :] * stride_bn
                + offs_r[:, None] * stride_br,
                mask=r_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
            if UPCAST or IEEE:
                acc = tl.dot(t, b.to(tl.float32), acc, input_precision="ieee")
            else:
                t_hi = t.to(b.dtype)
                t_lo = (t - t_hi.to(tl.float32)).to(b.dtype)
                acc = tl.dot(t_hi, b, acc)
                acc = tl.dot(t_lo, b, acc)
    return acc
