"""Device helpers shared by the expert GEMM kernels: program ordering, block rows, dots,
and the LoRA expand (slot groups per dot). Pure tile arithmetic; no policy."""

from __future__ import annotations

import triton
import triton.language as tl

from ..tiling.geometry import RANK_STEP as _STEP
from .output import as_stored

RANK_STEP = tl.constexpr(_STEP)  # a jit function reads only constexpr globals


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
    row0,
    num_pairs,
    top_k,
    num_slots,
    ROWS: tl.constexpr,
    HAS_LORA: tl.constexpr,
):
    """For the sorted rows [row0, row0 + ROWS): pair (sentinel num_pairs on padding rows),
    row_valid, slot (-1 = no adapter)."""
    offs_m = row0 + tl.arange(0, ROWS)
    pair = tl.load(sorted_pair_ids_ptr + offs_m)
    row_valid = pair < num_pairs
    pair = tl.where(row_valid, pair, 0)  # safe address for padding rows; results masked
    if HAS_LORA:
        slot = tl.load(slots_ptr + pair // top_k, mask=row_valid, other=-1)
        slot = tl.where(row_valid & (slot >= 0) & (slot < num_slots), slot, -1)
    else:
        slot = tl.full([ROWS], -1, tl.int32)
    return pair, row_valid, slot


@triton.jit
def lora_tile(tiles_ptr, tile, BLOCK_M: tl.constexpr):
    """LoRA shrink tile `tile` (align.py): (offs_m its BLOCK_M sorted-order rows, row_ok
    inside the tile, expert, slot; expert or slot < 0: no work)."""
    start = tl.load(tiles_ptr + tile * 4)
    end = tl.load(tiles_ptr + tile * 4 + 1)
    expert = tl.load(tiles_ptr + tile * 4 + 2)
    slot = tl.load(tiles_ptr + tile * 4 + 3)
    offs_m = start + tl.arange(0, BLOCK_M)
    return offs_m, offs_m < end, expert, slot


@triton.jit
def z_rows(row0, pair, ROWS: tl.constexpr, Z_SORTED: tl.constexpr):
    """int64 row of z for each of the sorted rows [row0, row0 + ROWS): its place in the
    sorted order (Z_SORTED: a block's rows are contiguous) or its pair index."""
    if Z_SORTED:
        return (row0 + tl.arange(0, ROWS)).to(tl.int64)
    return pair.to(tl.int64)


@triton.jit
def mma(a, b, acc, IEEE: tl.constexpr):
    """acc += a @ b; IEEE keeps fp32 operands exact (no tf32) for fp32 inputs."""
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


def tail_variants(half_tail: bool, block_m: int) -> int:
    """Row variants of the GEMM kernels: 2 with half_tail (blocks whose second half is
    padding run BLOCK_M // 2 rows) where that half is still a dot tile (>= 16 rows)."""
    return 2 if half_tail and block_m >= 32 else 1


@triton.jit
def expand_dot(t, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr, ONE_DOT: tl.constexpr):
    """acc += t (fp32) @ b. fp32 b (IEEE): one exact dot, whatever ONE_DOT says. 16-bit b:
    t is split into a high and a low 16-bit part, so two native dots keep ~16 mantissa bits
    of the fp32 intermediate; with ONE_DOT, t rounded to b's dtype (to nearest even) and
    one native dot, the intermediate in the serving dtype as HF + PEFT (lora_B(lora_A(x)))
    and vLLM compute it. UPCAST (the interpreter's bf16): the same t, then an fp32 dot."""
    if IEEE or (UPCAST and not ONE_DOT):
        acc = tl.dot(t, b.to(tl.float32), acc, input_precision="ieee")
    elif ONE_DOT:
        t_16 = as_stored(t, b.dtype)  # the GPU's cast; in the interpreter rounded by bits
        if UPCAST:
            acc = tl.dot(t_16.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(t_16, b, acc)
    else:
        t_hi = t.to(b.dtype)
        t_lo = (t - t_hi.to(tl.float32)).to(b.dtype)
        acc = tl.dot(t_hi, b, acc)
        acc = tl.dot(t_lo, b, acc)
    return acc


@triton.jit
def max_width(ranks_ptr, num_slots, BLOCK_L: tl.constexpr):
    """The largest slot width of the bank: a real rank rounded up to RANK_STEP (0 when
    every slot is empty)."""
    offs_l = tl.arange(0, BLOCK_L)
    r = tl.load(ranks_ptr + offs_l, mask=offs_l < num_slots, other=0)
    return tl.max((r + RANK_STEP - 1) // RANK_STEP * RANK_STEP, axis=0)


@triton.jit
def lora_expand(
    acc_g,
    acc_u,
    inter_ptr,
    stride_im,
    stride_is,
    stride_ir,
    pair,
    slot,
    num_slots,
    b_ptr,
    stride_bl,
    stride_bs,
    stride_bn,
    stride_br,
    offs_n,
    n_mask,
    ranks_ptr,
    max_rank,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SLOTS_PER_DOT: tl.constexpr,
    TWO_PARTS: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    PIPELINED: tl.constexpr,
    ONE_DOT: tl.constexpr,
):
    """acc [BLOCK_M, BLOCK_N] += per row: inter[pair] (fp32) @ B[slot]^T over the slot's
    rank, for the gate part into acc_g and (TWO_PARTS) the up part into acc_u.

    One dot covers SLOTS_PER_DOT slots and BLOCK_R rank columns of each: its K lanes are
    (slot, r) pairs; a row's A operand holds its intermediate in its own slot's lanes and
    zeros elsewhere, and the B operand stacks those slots' B columns. So the loads of a
    group are one round trip (all its slots' B tiles at once, both parts) instead of one
    per slot, at the price of dot lanes for slots absent from the block; groups with no row
    in the block are skipped. BLOCK_R comes from the bank's tile rank (the largest real
    rank loaded), so an R = 128 bank of rank-8 adapters runs the lanes of an R = 16 bank;
    each group runs `passes` dots of BLOCK_R columns, enough for the widest slot of the
    bank (one when the tile rank is current; none when every slot is empty), columns past
    R = max_rank cut. The columns are the same for every lane of a slot, so the loads stay
    vectorised: a slot's columns past its rank meet an intermediate the shrink wrote as
    zeros (lora_shrink's fill_block), and B there is multiplied by them (the bank must be
    finite everywhere, weights.LoRABank). PIPELINED (expand_first): one flat loop over
    (group, pass) with no per-group skip (a branch in the loop body stops Triton's software
    pipelining), so the loads are issued stages ahead of their dots; an absent group's t
    loads are masked off and its dots add zeros. On both paths a group's B lanes are
    loaded for each of its slots below num_slots, used by a row of the block or not, and
    multiply zeros there. Masking B by slot use measured 4-9% slower with LoRA on the H200
    (1504b23: T = 4096 0.930 -> 1.016 ms).
    ONE_DOT: each dot's intermediate rounded to B's dtype first (expand_dot).
    inter_ptr is at part 0 (part stride stride_is); b_ptr at (slot 0, expert, part 0)."""
    passes = tl.cdiv(max_width(ranks_ptr, num_slots, BLOCK_L), BLOCK_R)
    offs_q = tl.arange(0, SLOTS_PER_DOT * BLOCK_R)
    q_slot = offs_q // BLOCK_R
    q_r = offs_q % BLOCK_R
    has = slot >= 0
    first = tl.min(tl.where(has, slot, num_slots), axis=0)
    last = tl.max(slot, axis=0)  # -1 when no row of the block has an adapter
    g_lo = first // SLOTS_PER_DOT
    g_hi = tl.where(last >= 0, last // SLOTS_PER_DOT, -1)
    if PIPELINED:
        for i in tl.range(0, (g_hi + 1 - g_lo) * passes, num_stages=2):
            g = g_lo + i // passes
            cols = q_r + (i % passes) * BLOCK_R
            acc_g, acc_u = _expand_group(
                acc_g, acc_u, inter_ptr, stride_im, stride_is, stride_ir, pair, slot, num_slots,
                b_ptr, stride_bl, stride_bs, stride_bn, stride_br, offs_n, n_mask, q_slot, cols,
                cols < max_rank, g * SLOTS_PER_DOT, TWO_PARTS, UPCAST, IEEE, ONE_DOT,
            )  # fmt: skip
    else:
        # one flat loop too (a nested pass loop would be software-pipelined on its own,
        # multi-buffering its loads: 640 KB of shared memory in the sm_90 compile)
        for i in range(0, (g_hi + 1 - g_lo) * passes):
            s0 = (g_lo + i // passes) * SLOTS_PER_DOT
            in_group = has & (slot >= s0) & (slot < s0 + SLOTS_PER_DOT)
            if tl.max(in_group.to(tl.int32), axis=0) > 0:
                cols = q_r + (i % passes) * BLOCK_R
                acc_g, acc_u = _expand_group(
                    acc_g, acc_u, inter_ptr, stride_im, stride_is, stride_ir, pair, slot,
                    num_slots, b_ptr, stride_bl, stride_bs, stride_bn, stride_br, offs_n,
                    n_mask, q_slot, cols, cols < max_rank, s0, TWO_PARTS, UPCAST, IEEE, ONE_DOT,
                )  # fmt: skip
    return acc_g, acc_u


@triton.jit
def _expand_group(
    acc_g,
    acc_u,
    inter_ptr,
    stride_im,
    stride_is,
    stride_ir,
    pair,
    slot,
    num_slots,
    b_ptr,
    stride_bl,
    stride_bs,
    stride_bn,
    stride_br,
    offs_n,
    n_mask,
    q_slot,
    q_r,
    q_ok,
    s0,
    TWO_PARTS: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    ONE_DOT: tl.constexpr,
):
    """One expand dot of lora_expand: the slots [s0, s0 + SLOTS_PER_DOT), columns q_r."""
    lane_slot = s0 + q_slot
    sel = (slot[:, None] == lane_slot[None, :]) & q_ok[None, :]
    t_ptrs = inter_ptr + pair[:, None] * stride_im + q_r[None, :] * stride_ir
    b_ptrs = (
        b_ptr
        + lane_slot[:, None].to(tl.int64) * stride_bl  # L*E*... can exceed 2**31
        + offs_n[None, :] * stride_bn
        + q_r[:, None] * stride_br
    )
    b_mask = (q_ok & (lane_slot < num_slots))[:, None] & n_mask[None, :]
    t_g = tl.load(t_ptrs, mask=sel, other=0.0)
    b_g = tl.load(b_ptrs, mask=b_mask, other=0.0)
    if TWO_PARTS:
        t_u = tl.load(t_ptrs + stride_is, mask=sel, other=0.0)
        b_u = tl.load(b_ptrs + stride_bs, mask=b_mask, other=0.0)
        acc_g = expand_dot(t_g, b_g, acc_g, UPCAST, IEEE, ONE_DOT)
        acc_u = expand_dot(t_u, b_u, acc_u, UPCAST, IEEE, ONE_DOT)
    else:
        acc_g = expand_dot(t_g, b_g, acc_g, UPCAST, IEEE, ONE_DOT)
    return acc_g, acc_u


@triton.jit
def add_delta(
    acc_g,
    acc_u,
    delta_ptr,
    stride_dm,
    stride_ds,
    stride_dn,
    pair,
    slot,
    offs_n,
    n_mask,
    TWO_PARTS: tl.constexpr,
):
    """acc [BLOCK_M, BLOCK_N] += the LoRA delta rows (lora_delta) of rows with an adapter:
    part 0 into acc_g, (TWO_PARTS) part 1 into acc_u. delta_ptr is at (pair 0, part 0)."""
    mask = (slot >= 0)[:, None] & n_mask[None, :]
    d_ptrs = delta_ptr + pair[:, None].to(tl.int64) * stride_dm + offs_n[None, :] * stride_dn
    acc_g += tl.load(d_ptrs, mask=mask, other=0.0).to(tl.float32)
    if TWO_PARTS:
        acc_u += tl.load(d_ptrs + stride_ds, mask=mask, other=0.0).to(tl.float32)
    return acc_g, acc_u
