"""What the launchers pass alike: a tensor's strides under the kernels' `stride_<tensor><dim>`
names, a LoRA factor with its parts dimension, and the LoRA shrink tiles' work list. Pure
bookkeeping; no policy."""

from __future__ import annotations

import torch

from ..tiling.geometry import shrink_tile_rows
from .align import AlignedPairs


def strides(name: str, t: torch.Tensor | None, dims: str) -> dict[str, int]:
    """{"stride_<name><d>": t.stride(i)} for the i-th letter d of `dims` (the kernel's
    legend letters, outermost first: strides("a", lora_a, "lesrk") gives stride_al ...
    stride_ak); zeros when t is None (an input the kernel then never reads)."""
    if t is None:
        return {f"stride_{name}{d}": 0 for d in dims}
    assert t.dim() == len(dims), f"{name}: {t.dim()}-d tensor for strides {dims!r}"
    return {f"stride_{name}{d}": t.stride(i) for i, d in enumerate(dims)}


def with_parts(factor: torch.Tensor) -> torch.Tensor:
    """A LoRA factor as the kernels index it, [L, E, S, ., .]: w13's as is, w2's [L, E, ., .]
    viewed with S = 1."""
    return factor if factor.dim() == 5 else factor.unsqueeze(2)


def lora_tile_args(aligned: AlignedPairs) -> dict:
    """The work list of the kernels over the LoRA shrink tiles (align.py): the sorted pairs,
    the tile rows and their count, and BLOCK_M, the tile's rows padded for the dots."""
    return {
        "sorted_pair_ids_ptr": aligned.sorted_pair_ids,
        "tiles_ptr": aligned.lora_tiles,
        "num_tiles_ptr": aligned.num_lora_tiles,
        "BLOCK_M": shrink_tile_rows(aligned.lora_tile_m),
    }
