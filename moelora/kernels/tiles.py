"""Device helpers shared by the expert GEMM kernels: program ordering, block rows, dots,
and the LoRA expand (slot groups per dot). Pure tile arithmetic; no policy."""

from __future__ import annotations

import triton
import triton.language as tl

from ..tiling.geometry import RANK_STEP as _STEP

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
def expand_dot(t, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc += t (fp32) @ b. 16-bit b: t is split into a high and a low 16-bit part, so two
    native dots keep ~16 mantissa bits of the fp32 intermediate."""
    if UPCAST or IEEE:
        acc = tl.dot(t, b.to(tl.float32), acc, input_precision="ieee")
    else:
        t_hi = t.to(b.dtype)
        t_lo = (t - t_hi.to(tl.float32)).to(b.dtype)
        acc = tl.dot(t_hi, b, acc)
        acc = tl.dot(t_lo, b, acc)
    return acc


@triton.jit
def slot_runs(ranks_ptr, num_slots, BLOCK_L: tl.constexpr):
    """The packed rank lanes of the bank, in runs of RANK_STEP lanes: slot s owns the runs
    [end[s] - runs[s], end[s]), runs[s] = its real rank / RANK_STEP rounded up (0 for an
    empty slot). -> (offs_l [BLOCK_L] slot ids, runs, end); slots >= num_slots own none."""
    offs_l = tl.arange(0, BLOCK_L)
    r = tl.load(ranks_ptr + offs_l, mask=offs_l < num_slots, other=0)
    runs = (r + RANK_STEP - 1) // RANK_STEP
    return offs_l, runs, tl.cumsum(runs, axis=0)


@triton.jit
def run_map(run, run_hi, runs, end):
    """For runs `run` [G]: (slot, r0, ok): the slot owning the run, the run's first rank
    column (a multiple of RANK_STEP by construction, which lets the loads over its
    RANK_STEP consecutive columns vectorise) and ok = below run_hi."""
    before = end[None, :] <= run[:, None]  # [G, BLOCK_L]: slots wholly before the run
    run_slot = tl.sum(before.to(tl.int32), axis=1)
    r0 = (run - tl.sum(tl.where(before, runs[None, :], 0), axis=1)) * RANK_STEP
    return run_slot, r0, run < run_hi


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
    rank_size,
    BLOCK_L: tl.constexpr,
    DOT_LANES: tl.constexpr,
    TWO_PARTS: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    PIPELINED: tl.constexpr,
):
    """acc [BLOCK_M, BLOCK_N] += per row: inter[pair, :r] (fp32) @ B[slot, :, :r]^T, r the
    slot's real rank (ranks_ptr; rank_size: the factors' R, which a width past it is cut
    to), for the gate part into acc_g and (TWO_PARTS) the up part
    into acc_u.

    The K lanes of the dots are the bank's packed rank lanes (slot_runs): each slot owns
    its real rank rounded up to RANK_STEP, so an R = 128 bank of rank-8 adapters costs what
    an R = 16 bank does, and an empty slot costs nothing. One dot covers DOT_LANES
    consecutive lanes (DOT_LANES / RANK_STEP runs) of the slots [first, last] that the
    block's rows use; a row's A operand holds its intermediate in its own slot's lanes and
    zeros elsewhere, and the B operand stacks those lanes' B columns, so the loads of a dot
    are one round trip for every slot it covers. PIPELINED (expand_first): no per-dot skip
    (a branch in the loop body stops Triton's software pipelining), so the loads are issued
    stages ahead of their dots; a dot without rows adds zeros. On both paths a dot loads B
    for every slot whose lanes it covers, used by a row of the block or not, and multiplies
    zeros there, and a slot's columns [r, its width) meet a zero intermediate (the shrink
    writes zeros up to the width): the bank must be finite there (weights.LoRABank);
    columns past a slot's width are never loaded. Masking B by slot use measured 4-9%
    slower with LoRA on the H200 (1504b23: T = 4096 0.930 -> 1.016 ms).
    inter_ptr is at part 0 (part stride stride_is); b_ptr at (slot 0, expert, part 0)."""
    offs_l, runs, end = slot_runs(ranks_ptr, num_slots, BLOCK_L)
    has = slot >= 0
    first = tl.min(tl.where(has, slot, num_slots), axis=0)
    last = tl.max(slot, axis=0)  # -1 when no row of the block has an adapter
    run_lo = tl.sum(tl.where(offs_l < first, runs, 0), axis=0)
    run_hi = tl.sum(tl.where(offs_l <= last, runs, 0), axis=0)
    offs_g = tl.arange(0, DOT_LANES // RANK_STEP)
    if PIPELINED:
        for g0 in tl.range(run_lo, run_hi, DOT_LANES // RANK_STEP, num_stages=2):
            run_slot, r0, ok = run_map(g0 + offs_g, run_hi, runs, end)
            acc_g, acc_u = _expand_dot_runs(
                acc_g, acc_u, inter_ptr, stride_im, stride_is, stride_ir, pair, slot, b_ptr,
                stride_bl, stride_bs, stride_bn, stride_br, offs_n, n_mask, run_slot, r0, ok,
                rank_size, DOT_LANES, TWO_PARTS, UPCAST, IEEE,
            )  # fmt: skip
    else:
        for g0 in range(run_lo, run_hi, DOT_LANES // RANK_STEP):
            run_slot, r0, ok = run_map(g0 + offs_g, run_hi, runs, end)
            s_lo = tl.min(tl.where(ok, run_slot, num_slots), axis=0)
            s_hi = tl.max(tl.where(ok, run_slot, -1), axis=0)
            in_dot = has & (slot >= s_lo) & (slot <= s_hi)
            if tl.max(in_dot.to(tl.int32), axis=0) > 0:
                acc_g, acc_u = _expand_dot_runs(
                    acc_g, acc_u, inter_ptr, stride_im, stride_is, stride_ir, pair, slot, b_ptr,
                    stride_bl, stride_bs, stride_bn, stride_br, offs_n, n_mask, run_slot, r0,
                    ok, rank_size, DOT_LANES, TWO_PARTS, UPCAST, IEEE,
                )  # fmt: skip
    return acc_g, acc_u


@triton.jit
def _expand_dot_runs(
    acc_g,
    acc_u,
    inter_ptr,
    stride_im,
    stride_is,
    stride_ir,
    pair,
    slot,
    b_ptr,
    stride_bl,
    stride_bs,
    stride_bn,
    stride_br,
    offs_n,
    n_mask,
    run_slot,
    r0,
    ok,
    rank_size,
    DOT_LANES: tl.constexpr,
    TWO_PARTS: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One expand dot of lora_expand over the runs (run_slot, r0) where ok: the dot's
    DOT_LANES lanes are the runs' RANK_STEP consecutive columns each, laid out as a
    [runs, RANK_STEP] grid of offsets flattened to the lanes (so the compiler sees the
    contiguous columns and vectorises the loads), columns past R = rank_size cut."""
    cols = r0[:, None] + tl.arange(0, RANK_STEP)[None, :]  # [G, RANK_STEP]
    runs: tl.constexpr = DOT_LANES // RANK_STEP
    lane_r = tl.reshape(cols, (DOT_LANES,))
    lane_slot = tl.reshape(tl.broadcast_to(run_slot[:, None], (runs, RANK_STEP)), (DOT_LANES,))
    lane_ok = tl.reshape(ok[:, None] & (cols < rank_size), (DOT_LANES,))
    sel = (slot[:, None] == lane_slot[None, :]) & lane_ok[None, :]
    t_ptrs = inter_ptr + pair[:, None] * stride_im + lane_r[None, :] * stride_ir
    b_ptrs = (
        b_ptr
        + lane_slot[:, None].to(tl.int64) * stride_bl  # L*E*... can exceed 2**31
        + offs_n[None, :] * stride_bn
        + lane_r[:, None] * stride_br
    )
    b_mask = lane_ok[:, None] & n_mask[None, :]
    t_g = tl.load(t_ptrs, mask=sel, other=0.0)
    b_g = tl.load(b_ptrs, mask=b_mask, other=0.0)
    if TWO_PARTS:
        t_u = tl.load(t_ptrs + stride_is, mask=sel, other=0.0)
        b_u = tl.load(b_ptrs + stride_bs, mask=b_mask, other=0.0)
        acc_g = expand_dot(t_g, b_g, acc_g, UPCAST, IEEE)
        acc_u = expand_dot(t_u, b_u, acc_u, UPCAST, IEEE)
    else:
        acc_g = expand_dot(t_g, b_g, acc_g, UPCAST, IEEE)
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
