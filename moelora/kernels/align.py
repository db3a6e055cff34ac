"""Routing alignment: sort the (token, k) pairs by expert into BLOCK_M-padded blocks.

All on the device with torch ops and no host synchronisation, so it can be captured in a
CUDA graph. Inside an expert the pairs are ordered by adapter slot, so a block holds few
distinct slots and the LoRA loops in the kernels visit only those.

Legend: T tokens, K top-k, E experts, L slots, P = T*K pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AlignedPairs:
    """sorted_pair_ids [P_pad] int32: pair index t*K + j, grouped by expert, each expert's
    group padded to a multiple of block_m with the sentinel P; block_experts [P_pad/BLOCK_M]
    int32: expert of each block (-1 past the end); num_padded [1] int32: used length."""

    sorted_pair_ids: torch.Tensor
    block_experts: torch.Tensor
    num_padded: torch.Tensor
    block_m: int

    @property
    def num_blocks(self) -> int:
        """Static upper bound on the number of blocks (the grid size)."""
        return self.block_experts.shape[0]


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the padded length: each non-empty expert wastes < block_m rows, and
    at most min(P, E) experts are non-empty."""
    padded = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return -(-padded // block_m) * block_m


def align_pairs(
    topk_ids: torch.Tensor,
    token_slots: torch.Tensor | None,
    num_experts: int,
    num_slots: int,
    block_m: int,
) -> AlignedPairs:
    """topk_ids [T, K] (ids outside [0, E) are dropped: expert parallel); token_slots [T]
    (-1 or out of [0, L) = no adapter) or None. Returns the block layout of the pairs."""
    device = topk_ids.device
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < num_experts)
    ids = torch.where(valid, ids, torch.full_like(ids, num_experts))  # bucket E = dropped
    if num_pairs * 4 <= num_experts:
        return _one_pair_per_block(ids, num_experts, num_pairs, block_m)
    if token_slots is None:
        slot = torch.zeros_like(ids)
    else:
        # expand, not repeat_interleave: no output-size computation that could sync
        s = token_slots.to(torch.int64).unsqueeze(1).expand(-1, top_k).reshape(-1)
        slot = torch.where((s >= 0) & (s < num_slots), s + 1, torch.zeros_like(s))
    key = ids * (num_slots + 1) + slot
    order = torch.sort(key, stable=True).indices  # pair indices by (expert, slot)
    sorted_ids = ids[order]

    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.index_add_(0, ids, torch.ones_like(ids))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    start = torch.cumsum(counts, 0) - counts

    cap = max_padded_pairs(num_pairs, num_experts, block_m)
    sorted_pair_ids = torch.full((cap + 1,), num_pairs, dtype=torch.int32, device=device)
    e = sorted_ids.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=device) - start[e]
    dest = torch.where(sorted_ids < num_experts, pad_start[e] + rank, torch.full_like(rank, cap))
    sorted_pair_ids.scatter_(0, dest, order.to(torch.int32))  # dropped pairs land in slot cap

    block_start = torch.arange(0, cap, block_m, device=device)
    block_experts = torch.searchsorted(pad_end, block_start, right=True)
    block_experts = torch.where(
        block_experts < num_experts, block_experts, torch.full_like(block_experts, -1)
    )
    return AlignedPairs(
        sorted_pair_ids=sorted_pair_ids[:cap],
        block_experts=block_experts.to(torch.int32),
        num_padded=pad_end[-1:].to(torch.int32),
        block_m=block_m,
    )


def _one_pair_per_block(
    ids: torch.Tensor, num_experts: int, num_pairs: int, block_m: int
) -> AlignedPairs:
    """Decode layout (P <= E/4: pairs rarely share an expert): block b holds pair b alone.
    Four small ops instead of the sort; a repeated expert is read twice, which costs less
    than the sort's launches at this size (vLLM's "naive" assignment, vllm_spec.md 4.1)."""
    device = ids.device
    sorted_pair_ids = torch.full((num_pairs, block_m), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[:, 0] = torch.arange(num_pairs, dtype=torch.int32, device=device)
    block_experts = torch.where(ids < num_experts, ids, torch.full_like(ids, -1))
    return AlignedPairs(
        sorted_pair_ids=sorted_pair_ids.reshape(-1),
        block_experts=block_experts.to(torch.int32),
        num_padded=torch.full((1,), num_pairs * block_m, dtype=torch.int32, device=device),
        block_m=block_m,
    )
