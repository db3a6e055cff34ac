"""Routing alignment: sort the (token, k) pairs by expert into BLOCK_M-padded blocks.

One Triton kernel on the device, no host synchronisation, so it can be captured in a
CUDA graph. Inside an expert the pairs are ordered by adapter slot (slot -1 first), so a
block holds few distinct slots and the LoRA loops in the kernels visit only those.

How: a pair's bucket is key = expert * (L + 1) + slot + 1. COUNT: an atomic add per pair
on counts[key] returns the pair's rank inside its bucket. OFFSETS: one program turns the
counts into each expert's padded start (cumsum over experts) and each bucket's start
inside it (and, for the LoRA shrink tiles, each bucket's first tile index), writes the
padding sentinels, block experts and the used length. SCATTER: sorted[key_start[key] +
rank] = pair, and a pair whose rank is a multiple of the tile rows writes the shrink tile
that starts at it (so tile writing is spread over the pairs, not looped per bucket). The
three phases run in one program (one launch, barriers between phases) or as three
launches (COUNT and SCATTER over many programs) after a memset of counts; for a few pairs
over many experts, one pair per block replaces the sort. Which, and with how many pairs
per step and warps, is the caller's AlignLaunch (tiling/align_launch.py).

Legend: T tokens, K top-k, E experts, L slots, P = T*K pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..tiling.align_launch import AlignLaunch, AlignMode
from .pdl import chain_point


@dataclass(frozen=True)
class AlignedPairs:
    """sorted_pair_ids [P_pad] int32: pair index t*K + j, grouped by expert, each expert's
    group padded to a multiple of block_m with the sentinel P (entries past num_padded are
    never read); block_experts [P_pad/BLOCK_M] int32: expert of each block (-1 past the
    end); num_padded [1] int32: used length.

    With slots and lora_tile_m > 0, the LoRA shrink's work list too: lora_tiles
    [max_tiles, 4] int32 rows (start, end, expert, slot), each at most lora_tile_m
    consecutive entries [start, end) of sorted_pair_ids that share one expert and one slot
    >= 0 (a run of one (expert, slot) bucket); num_lora_tiles [1] int32: rows used."""

    sorted_pair_ids: torch.Tensor
    block_experts: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    lora_tiles: torch.Tensor | None = None
    num_lora_tiles: torch.Tensor | None = None
    lora_tile_m: int = 0

    @property
    def num_blocks(self) -> int:
        """Static upper bound on the number of blocks (the grid size)."""
        return self.block_experts.shape[0]

    @property
    def max_lora_tiles(self) -> int:
        """Static upper bound on the LoRA shrink tiles (that grid's size)."""
        return 0 if self.lora_tiles is None else self.lora_tiles.shape[0]


def max_lora_tiles(num_pairs: int, num_experts: int, num_slots: int, tile_m: int) -> int:
    """Static bound on the shrink tiles: each non-empty (expert, slot) bucket adds at most
    one partial tile to the full ones, and at most min(P, E*L) buckets are non-empty."""
    return -(-num_pairs // tile_m) + min(num_pairs, num_experts * num_slots)


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the padded length: each non-empty expert wastes < block_m rows, and
    at most min(P, E) experts are non-empty."""
    padded = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return -(-padded // block_m) * block_m


@triton.jit
def _pair_keys(topk_ids_ptr, slots_ptr, offs, num_pairs, top_k, num_experts, num_slots,
               HAS_SLOTS: tl.constexpr):  # fmt: skip
    """key [BLOCK_P] of each pair and whether it is routed to a local expert."""
    in_range = offs < num_pairs
    e = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    ok = in_range & (e >= 0) & (e < num_experts)
    if HAS_SLOTS:
        s = tl.load(slots_ptr + offs // top_k, mask=ok, other=-1)
        s = tl.where((s >= 0) & (s < num_slots), s + 1, 0)
    else:
        s = tl.zeros_like(e)
    return tl.where(ok, e, 0) * (num_slots + 1) + s, ok


@triton.jit
def _align_kernel(
    topk_ids_ptr,
    slots_ptr,
    counts_ptr,
    rank_ptr,
    key_start_ptr,
    tile_start_ptr,
    sorted_pair_ids_ptr,
    block_experts_ptr,
    num_padded_ptr,
    lora_tiles_ptr,
    num_lora_tiles_ptr,
    num_pairs,
    top_k,
    num_experts,
    num_slots,
    num_blocks,
    HAS_SLOTS: tl.constexpr,
    TILES: tl.constexpr,
    TILE_M: tl.constexpr,
    ZERO: tl.constexpr,
    COUNT: tl.constexpr,
    OFFSETS: tl.constexpr,
    SCATTER: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PDL: tl.constexpr,
):
    chain_point(PDL)  # nothing is read before the wait (kernels/pdl.py)
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_P
    bins = num_slots + 1
    if ZERO:  # single-program mode: counts start at zero without a memset launch
        for q0 in range(0, num_experts * bins, BLOCK_P):
            q = q0 + tl.arange(0, BLOCK_P)
            tl.store(counts_ptr + q, tl.zeros_like(q), mask=q < num_experts * bins)
        tl.debug_barrier()
    if COUNT:
        for p0 in range(pid * BLOCK_P, num_pairs, step):
            offs = p0 + tl.arange(0, BLOCK_P)
            key, ok = _pair_keys(
                topk_ids_ptr, slots_ptr, offs, num_pairs, top_k, num_experts, num_slots, HAS_SLOTS
            )
            rank = tl.atomic_add(counts_ptr + key, tl.full([BLOCK_P], 1, tl.int32), mask=ok)
            tl.store(rank_ptr + offs, rank, mask=ok)
        tl.debug_barrier()
    if OFFSETS:
        for b0 in range(0, num_blocks, BLOCK_P):
            b = b0 + tl.arange(0, BLOCK_P)
            tl.store(block_experts_ptr + b, tl.full([BLOCK_P], -1, tl.int32), mask=b < num_blocks)
        tl.debug_barrier()  # the -1 fill lands before the experts' blocks overwrite it
        offs_s = tl.arange(0, BLOCK_S)
        offs_j = tl.arange(0, BLOCK_M)
        carry = tl.sum(tl.zeros([BLOCK_E], tl.int32), axis=0)  # padded rows before this chunk
        tile_carry = carry  # LoRA shrink tiles before this chunk
        for e0 in range(0, num_experts, BLOCK_E):
            offs_e = e0 + tl.arange(0, BLOCK_E)
            e_mask = offs_e < num_experts
            idx = offs_e[:, None] * bins + offs_s[None, :]
            cs_mask = e_mask[:, None] & (offs_s < bins)[None, :]
            c = tl.load(counts_ptr + idx, mask=cs_mask, other=0)
            total = tl.sum(c, axis=1)
            padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
            pad_end = tl.cumsum(padded, axis=0) + carry
            pad_start = pad_end - padded
            bucket_start = pad_start[:, None] + tl.cumsum(c, axis=1) - c
            tl.store(key_start_ptr + idx, bucket_start, cs_mask)
            if TILES:  # each bucket's first shrink tile; bin 0 (no adapter) gets none
                n_t = tl.where(cs_mask & (offs_s >= 1)[None, :], (c + TILE_M - 1) // TILE_M, 0)
                row_t = tl.sum(n_t, axis=1)
                t_start = (tl.cumsum(row_t, axis=0) - row_t + tile_carry)[:, None] + (
                    tl.cumsum(n_t, axis=1) - n_t
                )
                tl.store(tile_start_ptr + idx, t_start, cs_mask)
                tile_carry = tile_carry + tl.sum(row_t, axis=0)
            pad_pos = (pad_start + total)[:, None] + offs_j[None, :]
            tl.store(
                sorted_pair_ids_ptr + pad_pos,
                tl.full([BLOCK_E, BLOCK_M], 0, tl.int32) + num_pairs,
                mask=e_mask[:, None] & (pad_pos < pad_end[:, None]),
            )
            blocks = padded // BLOCK_M
            first = pad_start // BLOCK_M
            for j in range(0, tl.max(blocks, axis=0)):
                tl.store(block_experts_ptr + first + j, offs_e, mask=e_mask & (j < blocks))
            carry = carry + tl.sum(padded, axis=0)
        tl.store(num_padded_ptr, carry)
        if TILES:
            tl.store(num_lora_tiles_ptr, tile_carry)
        tl.debug_barrier()
    if SCATTER:
        for p0 in range(pid * BLOCK_P, num_pairs, step):
            offs = p0 + tl.arange(0, BLOCK_P)
            key, ok = _pair_keys(
                topk_ids_ptr, slots_ptr, offs, num_pairs, top_k, num_experts, num_slots, HAS_SLOTS
            )
            bucket = tl.load(key_start_ptr + key, mask=ok, other=0)
            rank = tl.load(rank_ptr + offs, mask=ok, other=0)
            tl.store(sorted_pair_ids_ptr + bucket + rank, offs, mask=ok)
            if TILES:  # the pair opening a run of TILE_M in its bucket writes that tile
                opens = ok & (key % bins != 0) & (rank % TILE_M == 0)
                row = lora_tiles_ptr + (tl.load(tile_start_ptr + key, mask=opens, other=0)
                                        + rank // TILE_M) * 4  # fmt: skip
                end = bucket + tl.load(counts_ptr + key, mask=opens, other=0)
                tl.store(row, bucket + rank, mask=opens)
                tl.store(row + 1, tl.minimum(end, bucket + rank + TILE_M), mask=opens)
                tl.store(row + 2, key // bins, mask=opens)
                tl.store(row + 3, key % bins - 1, mask=opens)


@triton.jit
def _one_pair_kernel(
    topk_ids_ptr,
    slots_ptr,
    sorted_pair_ids_ptr,
    block_experts_ptr,
    num_padded_ptr,
    lora_tiles_ptr,
    num_lora_tiles_ptr,
    num_pairs,
    top_k,
    num_experts,
    num_slots,
    TILES: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_P)
    in_range = offs < num_pairs
    e = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    e = tl.where((e >= 0) & (e < num_experts), e, -1)
    tl.store(block_experts_ptr + offs, e, mask=in_range)
    if TILES:  # pair b is tile b (rows [b * BLOCK_M, + 1)); expert or slot -1: no work
        s = tl.load(slots_ptr + offs // top_k, mask=in_range, other=-1)
        s = tl.where((s >= 0) & (s < num_slots) & (e >= 0), s, -1)
        row = lora_tiles_ptr + offs * 4
        tl.store(row, offs * BLOCK_M, mask=in_range)
        tl.store(row + 1, offs * BLOCK_M + 1, mask=in_range)
        tl.store(row + 2, e, mask=in_range)
        tl.store(row + 3, s, mask=in_range)
        tl.store(num_lora_tiles_ptr, num_pairs)
    offs_j = tl.arange(0, BLOCK_M)
    rows = tl.where(offs_j[None, :] == 0, offs[:, None], num_pairs)
    tl.store(
        sorted_pair_ids_ptr + offs[:, None] * BLOCK_M + offs_j[None, :], rows, in_range[:, None]
    )
    tl.store(num_padded_ptr, num_pairs * BLOCK_M)


def align_pairs(
    topk_ids: torch.Tensor,
    token_slots: torch.Tensor | None,
    num_experts: int,
    num_slots: int,
    block_m: int,
    lora_tile_m: int = 0,
    pdl: bool = False,
    *,
    launch: AlignLaunch,
) -> AlignedPairs:
    """topk_ids [T, K] (ids outside [0, E) are dropped: expert parallel); token_slots [T]
    int32 (-1 or out of [0, L) = no adapter) or None; lora_tile_m > 0 (with slots): also
    the LoRA shrink tiles of at most that many rows; pdl: the OFFSETS and SCATTER launches
    of three-launch mode use PDL (kernels/pdl.py); launch: the mode, pairs per step and
    warps (tiling/align_launch.py). Returns the block layout of the pairs."""
    device = topk_ids.device
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    ids = topk_ids.contiguous()
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    has_slots = token_slots is not None and num_slots > 0
    tiles = has_slots and lora_tile_m > 0
    decode = launch.mode is AlignMode.ONE_PAIR
    lora_tiles = num_lora_tiles = None
    if tiles:
        max_tiles = (
            num_pairs if decode else max_lora_tiles(num_pairs, num_experts, num_slots, lora_tile_m)
        )
        lora_tiles = torch.empty(max_tiles, 4, dtype=torch.int32, device=device)
        num_lora_tiles = torch.empty(1, dtype=torch.int32, device=device)
    # the arguments both alignment kernels take
    common = dict(
        topk_ids_ptr=ids,
        slots_ptr=token_slots if has_slots else ids,
        num_padded_ptr=num_padded,
        lora_tiles_ptr=lora_tiles if tiles else num_padded,
        num_lora_tiles_ptr=num_lora_tiles if tiles else num_padded,
        num_pairs=num_pairs,
        top_k=top_k,
        num_experts=num_experts,
        num_slots=num_slots if has_slots else 0,
        TILES=tiles,
        BLOCK_M=block_m,
    )
    if decode:
        sorted_pair_ids, block_experts = _one_pair_per_block(common)
        tile_m = 1 if tiles else 0
    else:
        sorted_pair_ids, block_experts = _sort_pairs(common, lora_tile_m, launch, pdl)
        tile_m = lora_tile_m if tiles else 0
    return AlignedPairs(
        sorted_pair_ids, block_experts, num_padded, block_m, lora_tiles, num_lora_tiles, tile_m
    )


def _sort_pairs(
    common: dict, lora_tile_m: int, launch: AlignLaunch, pdl: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sort (module docstring) in one launch or three, as `launch` says; common: the
    arguments both alignment kernels take. -> (sorted_pair_ids, block_experts)."""
    num_pairs, num_experts, block_m = common["num_pairs"], common["num_experts"], common["BLOCK_M"]
    device = common["topk_ids_ptr"].device
    cap = max_padded_pairs(num_pairs, num_experts, block_m)
    single = launch.mode is AlignMode.SINGLE
    sorted_pair_ids = torch.empty(cap, dtype=torch.int32, device=device)
    block_experts = torch.empty(cap // block_m, dtype=torch.int32, device=device)
    bins = common["num_slots"] + 1  # num_slots is 0 without slots: one bin per expert
    counts = (torch.empty if single else torch.zeros)(
        num_experts * bins, dtype=torch.int32, device=device
    )
    block_s = triton.next_power_of_2(bins)
    args = dict(
        **common,
        counts_ptr=counts,
        rank_ptr=torch.empty(num_pairs, dtype=torch.int32, device=device),
        key_start_ptr=torch.empty_like(counts),
        tile_start_ptr=torch.empty_like(counts) if common["TILES"] else counts,
        sorted_pair_ids_ptr=sorted_pair_ids,
        block_experts_ptr=block_experts,
        num_blocks=block_experts.shape[0],
        HAS_SLOTS=bins > 1,
        TILE_M=max(1, lora_tile_m),
        BLOCK_P=launch.block_p,
        # experts per OFFSETS step: ~4K counters in registers, at most 128 experts
        BLOCK_E=max(1, min(128, 4096 // block_s)),
        BLOCK_S=block_s,
        PDL=pdl,
        num_warps=launch.num_warps,
    )
    phases = dict(ZERO=False, COUNT=False, OFFSETS=False, SCATTER=False)
    if single:
        _align_kernel[(1,)](**args, **{**phases, "ZERO": True, "COUNT": True, "OFFSETS": True,
                                       "SCATTER": True})  # fmt: skip
    else:
        grid = (triton.cdiv(num_pairs, launch.block_p),)
        _align_kernel[grid](**args, **{**phases, "COUNT": True})
        # COUNT follows the counts memset; OFFSETS and SCATTER may start early (PDL)
        offsets_args = {**args, "num_warps": launch.offsets_warps, "launch_pdl": pdl}
        _align_kernel[(1,)](**offsets_args, **{**phases, "OFFSETS": True})
        _align_kernel[grid](**args, launch_pdl=pdl, **{**phases, "SCATTER": True})
    return sorted_pair_ids, block_experts


def _one_pair_per_block(common: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode layout (P <= E/4: pairs rarely share an expert): block b holds pair b alone.
    One launch instead of the sort; a repeated expert is read twice, which costs less than
    the sort at this size (vLLM's "naive" assignment, vllm_spec.md 4.1). common: the
    arguments both alignment kernels take. -> (sorted_pair_ids, block_experts)."""
    num_pairs, device = common["num_pairs"], common["topk_ids_ptr"].device
    sorted_pair_ids = torch.empty(num_pairs * common["BLOCK_M"], dtype=torch.int32, device=device)
    block_experts = torch.empty(num_pairs, dtype=torch.int32, device=device)
    _one_pair_kernel[(1,)](
        **common,
        sorted_pair_ids_ptr=sorted_pair_ids,
        block_experts_ptr=block_experts,
        BLOCK_P=triton.next_power_of_2(num_pairs),
    )
    return sorted_pair_ids, block_experts
