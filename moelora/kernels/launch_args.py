"""What the launchers pass alike: a tensor's strides under the kernels' `stride_<tensor><dim>`
names, a LoRA factor with its parts dimension, and the argument groups several kernels
take as one Triton tuple (each group declared once, here). Pure bookkeeping; no policy.

A group is a NamedTuple: the kernel declares one parameter for it and reads its fields
(`x_quant.stride_xqm`); Triton specialises each field as it would a parameter of its own
(pointer alignment, ints divisible by 16 or equal to 1), so a group of parameters that
stood side by side compiles to the PTX they gave (docs/history/kernel_log.md v34: a group
of parameters that stood apart reorders the kernel's parameters, which moved registers and
spills on sm_90, so those stay flat). The fields keep the flat parameters' names, so
benchmarks/launch_diff.py records a launch alike either way. Field names must not be
`values` or `type` (attributes of Triton's own tuple).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..tiling.geometry import shrink_tile_rows
from .align import AlignedPairs


class QuantRows(NamedTuple):
    """The W8A8 input of a GEMM or GEMV (quant_rows.py): its rows as e4m3 [M, K] and their
    fp32 scales [M, G] (G = 1 per channel, read at stride_xsg 0)."""

    xq_ptr: torch.Tensor
    xs_ptr: torch.Tensor
    stride_xqm: int
    stride_xqk: int
    stride_xsm: int
    stride_xsg: int


class AlignedBlocks(NamedTuple):
    """The aligned pairs as the GEMMs walk them (align.py): the sorted pair ids, each
    block's expert and the padded pair count."""

    sorted_pair_ids_ptr: torch.Tensor
    block_experts_ptr: torch.Tensor
    num_padded_ptr: torch.Tensor


class LoRATiles(NamedTuple):
    """The work list of the kernels over the LoRA shrink tiles (align.py): the sorted pairs,
    the tile rows (start, end, expert, slot) and their count."""

    sorted_pair_ids_ptr: torch.Tensor
    tiles_ptr: torch.Tensor
    num_tiles_ptr: torch.Tensor


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


def aligned_blocks(aligned: AlignedPairs) -> AlignedBlocks:
    """The aligned blocks' group of the GEMM kernels."""
    return AlignedBlocks(aligned.sorted_pair_ids, aligned.block_experts, aligned.num_padded)


def lora_tile_args(aligned: AlignedPairs) -> dict:
    """The work list of the kernels over the LoRA shrink tiles (align.py) and BLOCK_M, the
    tile's rows padded for the dots."""
    return {
        "tiles": LoRATiles(aligned.sorted_pair_ids, aligned.lora_tiles, aligned.num_lora_tiles),
        "BLOCK_M": shrink_tile_rows(aligned.lora_tile_m),
    }
