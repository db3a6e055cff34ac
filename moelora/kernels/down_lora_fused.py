"""The down GEMM and the z-side LoRA in one launch (horizontal fusion, `fused_down_lora`).

Where the down side's LoRA is a delta the top-k reduce adds (delta_in_reduce, lora_stream)
and its shrink writes that delta itself (shrink_expand), the LoRA-free down GEMM and the
z-side shrink_expand both only read z: one 1-D grid holds both kinds of programs, each
taking its kind's branch (the kernel bodies are expert_down's and lora_shrink's device
functions). Interleaved, the memory-bound LoRA programs are resident beside the
compute-bound GEMM programs from the start, instead of getting SMs only as GEMM programs
retire (docs/history/kernel_log.md, "Where the LoRA time goes at prefill sizes").

Order: of the first n_lora * LORA_EVERY programs every LORA_EVERY-th is a LoRA tile, the
others the GEMM's programs in the GEMM's own (grouped) order; the GEMM's remaining programs
follow. One launch option for both kinds: the GEMM's num_warps and num_stages (the GEMM
programs hold the time; the shrink's loop pipelines at any depth). No PDL: the launch
waits for the up GEMM in stream order.

Legend: P pairs, H hidden, I intermediate, R rank, L slots, E experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import InputError
from ..tiling.plan import GemmPlan
from .align import AlignedPairs
from .expert_down import _expert_down, expert_down_launch
from .lora_shrink import _lora_shrink, lora_shrink_launch

# LoRA programs: one in LORA_EVERY of the first ones. 2 (1:1) is a starting point, not a
# measurement: at the Qwen3-30B-A3B shape and T = 4096 the z side's tile bound
# (max_lora_tiles, 16-row tiles) is ~0.5x (8 slots) to ~1.7x (64 slots) the GEMM's program
# bound (BLOCK_N 128), so 1:1 spreads the LoRA tiles over most of the grid; the launcher
# takes other values (lora_every, or this constant set at run time) for the device A/B.
LORA_EVERY = 2
# the two launches' options and PDL constexprs: the fused launch sets its own options and
# runs without PDL (its device functions take no PDL; the kernels wait before calling them)
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl", "PDL")


@triton.jit
def _down_lora_fused_kernel(
    num_lora_programs,
    num_gemm_programs,
    LORA_EVERY: tl.constexpr,
    # the z-side LoRA shrink_expand's arguments (_lora_shrink's, prefixed)
    shrink_in_ptr,
    shrink_a_ptr,
    shrink_inter_ptr,
    shrink_sorted_pair_ids_ptr,
    shrink_tiles_ptr,
    shrink_num_tiles_ptr,
    shrink_row_div,
    shrink_parts,
    shrink_part_groups,
    shrink_ranks_ptr,
    shrink_rank_offset,
    shrink_r_size,
    shrink_num_slots,
    shrink_k_dim,
    shrink_k_chunk,
    shrink_stride_im,
    shrink_stride_ik,
    shrink_stride_al,
    shrink_stride_ae,
    shrink_stride_as,
    shrink_stride_ar,
    shrink_stride_ak,
    shrink_stride_om,
    shrink_stride_os,
    shrink_stride_or,
    shrink_b_ptr,
    shrink_delta_ptr,
    shrink_n_size,
    shrink_stride_bl,
    shrink_stride_be,
    shrink_stride_bs,
    shrink_stride_bn,
    shrink_stride_br,
    shrink_stride_dm,
    shrink_stride_ds,
    shrink_stride_dn,
    SHRINK_BLOCK_M: tl.constexpr,
    SHRINK_BLOCK_K: tl.constexpr,
    SHRINK_BLOCK_R: tl.constexpr,
    SHRINK_PARTS_PER_PROG: tl.constexpr,
    SHRINK_BLOCK_L: tl.constexpr,
    SHRINK_FILL_BLOCK: tl.constexpr,
    SHRINK_SPLIT: tl.constexpr,
    SHRINK_ROWS_SORTED: tl.constexpr,
    SHRINK_EXPAND: tl.constexpr,
    SHRINK_BLOCK_N: tl.constexpr,
    SHRINK_UPCAST: tl.constexpr,
    SHRINK_IEEE: tl.constexpr,
    # the LoRA-free down GEMM's arguments (_expert_down's; the FP8 input ones defaulted)
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
    sorted_pair_ids_ptr,
    block_experts_ptr,
    num_padded_ptr,
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
    # each kind's LoRA expand as one 16-bit dot (tiles.expand_dot)
    SHRINK_ONE_DOT: tl.constexpr = False,
    ONE_DOT: tl.constexpr = False,
    xq_ptr=None,
    xs_ptr=None,
    stride_xqm=0,
    stride_xqk=0,
    stride_xsm=0,
    stride_xsg=0,
):
    pid = tl.program_id(0)
    # the first num_lora_programs * LORA_EVERY programs: every LORA_EVERY-th one a LoRA tile
    # (its shrink_expand grid is one program per tile: whole rank, one part, no split-K)
    if (pid < num_lora_programs * LORA_EVERY) & (pid % LORA_EVERY == 0):
        _lora_shrink(
            pid // LORA_EVERY, 0, 0,
            shrink_in_ptr, shrink_a_ptr, shrink_inter_ptr, shrink_sorted_pair_ids_ptr,
            shrink_tiles_ptr, shrink_num_tiles_ptr, shrink_row_div, shrink_parts,
            shrink_part_groups, shrink_ranks_ptr, shrink_rank_offset, shrink_r_size,
            shrink_num_slots, shrink_k_dim, shrink_k_chunk, shrink_stride_im, shrink_stride_ik,
            shrink_stride_al, shrink_stride_ae, shrink_stride_as, shrink_stride_ar,
            shrink_stride_ak, shrink_stride_om, shrink_stride_os, shrink_stride_or,
            shrink_b_ptr, shrink_delta_ptr, shrink_n_size, shrink_stride_bl, shrink_stride_be,
            shrink_stride_bs, shrink_stride_bn, shrink_stride_br, shrink_stride_dm,
            shrink_stride_ds, shrink_stride_dn, SHRINK_BLOCK_M, SHRINK_BLOCK_K, SHRINK_BLOCK_R,
            SHRINK_PARTS_PER_PROG, SHRINK_BLOCK_L, SHRINK_FILL_BLOCK, SHRINK_SPLIT,
            SHRINK_ROWS_SORTED, SHRINK_EXPAND, SHRINK_BLOCK_N, SHRINK_UPCAST, SHRINK_IEEE,
            SHRINK_ONE_DOT,
        )  # fmt: skip
        return
    # the others: the GEMM's programs in their own order (the LoRA programs before pid
    # skipped); where the LoRA tiles outnumber them, the last interleaved slots are idle
    gemm_pid = pid - tl.minimum(pid // LORA_EVERY + 1, num_lora_programs)
    if gemm_pid >= num_gemm_programs:
        return
    _expert_down(
        gemm_pid,
        z_ptr, w_ptr, z_desc, w_desc, ws_ptr, b_ptr, o_ptr, topk_weights_ptr, slots_ptr,
        inter_ptr, lora_b_ptr, delta_ptr, sorted_pair_ids_ptr, block_experts_ptr,
        num_padded_ptr, num_pairs, top_k, num_slots, ranks_ptr, max_rank, inter_size, hidden,
        lora_n_offset, lora_n_size, stride_zm, stride_zk, stride_we, stride_wn, stride_wk,
        stride_se, stride_sn, stride_sk, stride_be, stride_bn, stride_om, stride_on, stride_im,
        stride_ir, stride_ll, stride_le, stride_ln, stride_lr, stride_dm, stride_ds, stride_dn,
        num_pid_m, HAS_BIAS, HAS_LORA, DELTA, Z_SORTED, TMA, W_FP8, SCALE_N, SCALE_K,
        MUL_WEIGHT, ATOMIC, EXPAND_FIRST, TAIL_VARIANTS, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_L,
        BLOCK_R, SLOTS_PER_DOT, GROUP_M, UPCAST, IEEE, ONE_DOT, xq_ptr, xs_ptr, stride_xqm,
        stride_xqk, stride_xsm, stride_xsg,
    )  # fmt: skip


def down_lora_fused(
    z: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    aligned: AlignedPairs,
    gemm: GemmPlan,
    *,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    lora_ranks: torch.Tensor | None,
    tile_rank: int | None,
    rows: str,
    shrink_block_k: int,
    top_k: int,
    num_pairs: int,
    lora_every: int | None = None,
    **down,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (o [P, H], delta [P, 1, H]): expert_down's o of the LoRA-free GEMM (z, w2, b2,
    gemm and `down`, its other keywords: topk_weights, FP8 scales) and lora_shrink's delta
    of the z side (lora_a [L, E, R, I], expanded by lora_b [L, E, H, R] in the same program;
    z's rows "pairs" or "sorted" as the GEMM's), from one launch. lora_every: the
    interleave (module docstring), at least 2; None: the module's LORA_EVERY, read at the
    call (a device A/B may set it)."""
    if lora_every is None:
        lora_every = LORA_EVERY
    if lora_every < 2:
        raise InputError("lora_every", lora_every, "at least 2 (one LoRA program in every k)")
    gemm_grid, gemm_args, o = expert_down_launch(
        z, w2, b2, aligned, gemm, top_k=top_k, num_pairs=num_pairs, **down
    )
    lora_grid, lora_args, delta = lora_shrink_launch(
        z,
        lora_a,
        aligned,
        num_pairs=num_pairs,
        rows=rows,
        top_k=top_k,
        block_k=shrink_block_k,
        expand_b=lora_b,
        ranks=lora_ranks,
        tile_rank=tile_rank,
        one_dot=gemm.expand_one_dot,
    )
    assert lora_grid[1:] == (1, 1), "shrink_expand of one part: one program per tile"
    num_lora, num_gemm = lora_grid[0], gemm_grid[0]
    grid = (num_lora * lora_every + max(0, num_gemm - num_lora * (lora_every - 1)),)
    _down_lora_fused_kernel[grid](
        num_lora_programs=num_lora,
        num_gemm_programs=num_gemm,
        LORA_EVERY=lora_every,
        **{_shrink_name(k): v for k, v in lora_args.items() if k not in _LAUNCH_OPTIONS},
        **{k: v for k, v in gemm_args.items() if k not in _LAUNCH_OPTIONS},
        num_warps=gemm.tiles.num_warps,
        num_stages=gemm.tiles.num_stages,
    )
    return o, delta


def _shrink_name(name: str) -> str:
    """The fused kernel's name of a shrink argument: SHRINK_ + a constexpr's (upper case),
    shrink_ + another's."""
    return f"SHRINK_{name}" if name.isupper() else f"shrink_{name}"
