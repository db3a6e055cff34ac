"""What one forward of the `triton` backend will do, decided once from its tile config and
the call: the path (decode or aligned), how the LoRA terms are computed, how z is laid
out, how the top-k sum is done, and whether the kernels chain with PDL. The pipeline
(kernels/moe_lora.py) reads a `ForwardPlan` and decides nothing; docs/kernels.md says
what each choice does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum

from .align_launch import AlignLaunch, align_launch
from .config import GemmTiles, TileConfig


class LoRAPath(Enum):
    """How the aligned path computes the LoRA terms (the decode path has one way)."""

    NONE = "none"  # no bank or no token slots: the base layer only
    EXPAND = "expand"  # shrink, then each GEMM expands the fp32 intermediate itself
    DELTA = "delta"  # shrink, then an expand over the shrink tiles into delta rows (lora_delta)


class TopKSum(Enum):
    """How the pairs' rows are summed into y on the aligned path."""

    REDUCE = "reduce"  # the down GEMM writes o [P, H]; topk_reduce reads it back
    ATOMIC = "atomic"  # the down GEMM adds each row into an fp32 [T, H] sum (atomic_reduce)


@dataclass(frozen=True)
class GemmPlan:
    """How one expert GEMM launches: its tiles and the knobs that act on it."""

    tiles: GemmTiles
    group_m: int
    expand_lanes: int  # K lanes per in-GEMM expand dot
    expand_first: bool  # the in-GEMM expand as a pipelined loop before the K loop
    half_tail: bool  # half-height variant for blocks whose second half is padding
    tma: bool  # weight (and, down: z) tiles by TMA where the layout allows
    z_sorted: bool  # z rows in the sorted pair order
    expand_one_dot: bool  # 16-bit: the in-GEMM expand as one dot of t rounded to x's dtype


@dataclass(frozen=True)
class ForwardPlan:
    """Every decision of one forward (module docstring)."""

    tiles: TileConfig  # the config the kernels launch with
    decode: bool  # the decode path (GEMVs from the top-k ids) instead of the aligned one
    lora: LoRAPath  # the gate/up side's LoRA path (and the down side's, but for lora_stream)
    delta_by_shrink: bool  # DELTA: each shrink program writes its delta rows (shrink_expand)
    delta_in_reduce: bool  # DELTA: the top-k reduce adds the down delta, the down GEMM LoRA-free
    down_lora: LoRAPath  # the down side's path: DELTA when the reduce adds its delta
    lora_stream: bool  # the down side's shrink and delta on a side stream beside the down GEMM
    expand_one_dot: bool  # 16-bit: every LoRA expand one dot of t rounded to x's dtype
    top_k_sum: TopKSum
    pdl: bool  # the layer's kernels after the first launched with PDL
    early_loads: bool  # decode: each kernel's first weight step loaded before its wait
    up: GemmPlan
    down: GemmPlan

    @property
    def z_sorted(self) -> bool:
        return self.up.z_sorted

    def align(self, num_pairs: int, num_experts: int) -> AlignLaunch:
        """How the aligned path's routing alignment launches for this call's P pairs over
        E experts (tiling/align_launch.py: one pair per block, one program or three)."""
        return align_launch(num_pairs, num_experts)

    @property
    def down_gemm_lora(self) -> bool:
        """Whether the down GEMM adds a LoRA term itself."""
        return self.lora is not LoRAPath.NONE and not self.delta_in_reduce


@functools.lru_cache(maxsize=1024)
def plan_forward(
    cfg: TileConfig, *, lora: bool, sharded: bool, pdl_supported: bool, interpreted: bool
) -> ForwardPlan:
    """The plan of a forward with `cfg`. lora: a bank and token slots are given; sharded:
    fully sharded LoRA (collectives between the kernels); pdl_supported: the GPU runs PDL
    (moelora.device.gpu_limits); interpreted: Triton's CPU interpreter runs the kernels.

    - PDL only where the config asks, the GPU has it, and no collective sits between two
      kernels (docs/kernels.md, "Decode path").
    - The decode path's early weight loads pay only with PDL (alone they measured +12% at
      T = 8, docs/history/kernel_log.md v13); the interpreter runs them so that the CPU tests cover them.
    - lora_delta needs whole intermediates and whole-H B2 between shrink and expand: not
      under fully sharded LoRA, whose collectives sit there; its delta_in_reduce and
      shrink_expand act only with it.
    - atomic_reduce: not with delta_in_reduce, whose reduce pass adds the delta rows.
    - down_tma implies z_sorted (the TMA tiles of z need the sorted rows).
    - lora_stream: the down side takes the DELTA path with its delta added by the reduce
      (whatever the gate/up side does), so that the z shrink and the delta expand depend
      on z only and run on a side stream while the down GEMM runs LoRA-free; not under
      fully sharded LoRA (its all-reduce sits in that branch) nor on the decode path. The
      interpreter runs the same kernels in order (no streams on the CPU).
    - expand_one_dot: only where a LoRA expand runs (LoRA on, the aligned path: the decode
      GEMVs expand in fp32 registers); the kernels ignore it on fp32 inputs (exact dots).
    """
    pdl = cfg.pdl and pdl_supported and not interpreted and not sharded
    if not lora:
        path = LoRAPath.NONE
    elif cfg.lora_delta and not sharded and not cfg.decode:
        path = LoRAPath.DELTA
    else:
        path = LoRAPath.EXPAND
    delta = path is LoRAPath.DELTA
    stream = cfg.lora_stream and lora and not sharded and not cfg.decode
    in_reduce = (delta and cfg.delta_in_reduce) or stream
    z_sorted = cfg.z_sorted or cfg.down_tma
    one_dot = cfg.expand_one_dot and lora and not cfg.decode

    def gemm(tiles: GemmTiles, half_tail_bit: int, tma: bool) -> GemmPlan:
        return GemmPlan(
            tiles=tiles,
            group_m=cfg.group_m,
            expand_lanes=cfg.expand_lanes,
            expand_first=cfg.expand_first,
            half_tail=bool(cfg.half_tail & half_tail_bit),
            tma=tma,
            z_sorted=z_sorted,
            expand_one_dot=one_dot,
        )

    return ForwardPlan(
        tiles=cfg,
        decode=cfg.decode,
        lora=path,
        delta_by_shrink=delta and cfg.shrink_expand,
        delta_in_reduce=in_reduce,
        down_lora=LoRAPath.DELTA if in_reduce else path,
        lora_stream=stream and not interpreted,
        expand_one_dot=one_dot,
        top_k_sum=TopKSum.ATOMIC if cfg.atomic_reduce and not in_reduce else TopKSum.REDUCE,
        pdl=pdl,
        early_loads=cfg.pdl and (pdl or interpreted),
        up=gemm(cfg.up, 1, cfg.up_tma),
        down=gemm(cfg.down, 2, cfg.down_tma),
    )
