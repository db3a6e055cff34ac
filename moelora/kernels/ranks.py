"""Each slot's real rank as the kernels read it: the [L] int32 rank vector of the bank
(weights.LoRABank.ranks), checked, or every slot at the factors' R when a caller of a
launcher passes none; and the lanes of the in-GEMM expand dots. No policy."""

from __future__ import annotations

import torch

from ..errors import InputError
from ..tiling.geometry import expand_rank_block, slots_per_dot
from .checks import check_shape


def slot_ranks(
    factor: torch.Tensor | None, ranks: torch.Tensor | None, rank_dim: int
) -> torch.Tensor | None:
    """ranks [L] int32 on the factor's device (None: every slot at R = factor.shape[rank_dim]);
    None without a factor."""
    if factor is None:
        return None
    num_slots = factor.shape[0]
    if ranks is None:
        return torch.full(
            (num_slots,), factor.shape[rank_dim], dtype=torch.int32, device=factor.device
        )
    check_shape("lora ranks", ranks, (num_slots,))
    if ranks.dtype != torch.int32 or ranks.device != factor.device:
        raise InputError(
            "lora ranks",
            f"{ranks.dtype} on {ranks.device}",
            f"int32 on {factor.device} (LoRABank.ranks)",
        )
    return ranks.contiguous()


def expand_layout(
    lora_b: torch.Tensor | None,
    ranks: torch.Tensor | None,
    tile_rank: int | None,
    lanes: int,
    rank_dim: int,
) -> tuple[torch.Tensor | None, int, int]:
    """(ranks as slot_ranks gives them, BLOCK_R and slots per dot of the in-GEMM expand for
    a bank keyed on tile_rank (None: the factor's R) with `lanes` K lanes per dot);
    (None, 16, 1) without LoRA."""
    if lora_b is None:
        return None, 16, 1
    block_r = expand_rank_block(lora_b.shape[rank_dim] if tile_rank is None else tile_rank)
    per_dot = slots_per_dot(lora_b.shape[0], block_r, lanes)
    return slot_ranks(lora_b, ranks, rank_dim), block_r, per_dot
