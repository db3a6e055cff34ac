"""How the routing alignment (kernels/align.py) launches for P pairs: one pair per block
(decode layout), one program, or three launches; with how many pairs per step and warps.
Pure policy from the pair and expert counts; the kernel launches what it is given.

Legend: P = T*K pairs, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# Largest P aligned by one program (one launch, no memset). Measured on the H200
# (benchmarks/ab_align.py at 4661a39): P = 8192 in one program took 38-56 us against 14-17
# in three launches, and P = 2048 in one took 20.5 us against 23.6 as three.
SINGLE_PROGRAM_PAIRS = 2048
# Pairs per step and warps: of the one program in single mode; of each COUNT / SCATTER
# program in three-launch mode, where more, smaller programs spread the atomics over more
# SMs. H200 at 4661a39, three-launch mode with slots (8 adapters), graph replay: (1024, 4
# warps) -> (256, 8 warps) took 29.8 -> 16.6 us at T = 1024, 29.8 -> 19.2 at 4096, 36.8 ->
# 28.7 at 16384 (LoRA-free 18.4 -> 13.6 at 1024); single mode at T = 256 with slots 28.3 ->
# 20.5 us with (1024, 8 warps), where (256, 8) took 23.6.
# f393d39 (same tool): single mode at T = 256 (P = 2048) with slots 20.8 -> 17.9 us with
# (2048, 16 warps), LoRA-free 12.4 -> 10.3; at T = 64 (P = 512) 16 warps took 0.2-0.7 us
# more, so P <= 1024 keeps (1024, 8 warps). The OFFSETS program at 16 warps: 6.4 -> 5.4
# us with slots (4 warps: 10.5).
SINGLE_BLOCK_P = 1024
SINGLE_WARPS = 8
WIDE_SINGLE_PAIRS = 1024  # single mode above this P: (WIDE_BLOCK_P, WIDE_WARPS)
WIDE_BLOCK_P = 2048
WIDE_WARPS = 16
BLOCK_P = 256
ALIGN_WARPS = 8
OFFSETS_WARPS = 16  # the OFFSETS program of three-launch mode (one program: the cumsums)


class AlignMode(Enum):
    ONE_PAIR = "one_pair"  # P <= E/4: block b holds pair b alone (pairs rarely share experts)
    SINGLE = "single"  # one program runs the three phases, barriers between them
    THREE = "three"  # COUNT and SCATTER over many programs, OFFSETS in one, after a memset


@dataclass(frozen=True)
class AlignLaunch:
    """The alignment's launch: its mode, pairs per step and warps (of the one program in
    single mode, of each COUNT / SCATTER program in three-launch mode), and the OFFSETS
    program's warps (three-launch mode)."""

    mode: AlignMode
    block_p: int = BLOCK_P
    num_warps: int = ALIGN_WARPS
    offsets_warps: int = OFFSETS_WARPS


def align_launch(num_pairs: int, num_experts: int) -> AlignLaunch:
    """The launch for P = num_pairs over E = num_experts (the constants above)."""
    if num_pairs * 4 <= num_experts:
        return AlignLaunch(AlignMode.ONE_PAIR)
    if num_pairs > SINGLE_PROGRAM_PAIRS:
        return AlignLaunch(AlignMode.THREE, BLOCK_P, ALIGN_WARPS, OFFSETS_WARPS)
    if num_pairs > WIDE_SINGLE_PAIRS:
        return AlignLaunch(AlignMode.SINGLE, WIDE_BLOCK_P, WIDE_WARPS)
    return AlignLaunch(AlignMode.SINGLE, SINGLE_BLOCK_P, SINGLE_WARPS)
