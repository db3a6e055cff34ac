"""Fit a picked tile config to the GPU that runs it: the shared memory each kernel's
largest phase needs (the GEMM pipeline, the in-GEMM LoRA expand, the LoRA shrink),
modelled from Triton's sm_90 allocations, against what the device has per block; and no
TMA below sm_90. The model, the order of the reductions and how each was checked are in
docs/kernels.md ("Fitting a config to the GPU").

Pure: the device's limits come from moelora.device (`gpu_limits`), passed in.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..device import GpuLimits
from .config import GemmTiles, TileConfig
from .geometry import (
    EXPAND_BLOCK_N,
    SHRINK_STAGES,
    expand_dot_lanes,
    rank_block,
    shrink_parts_per_program,
    shrink_rank_block,
    shrink_tile_rows,
)

MARGIN = 1024  # bytes kept free per block: barriers and small scratch besides the phases
MIN_BLOCK_K = 16  # the smallest K of a tl.dot
MIN_BLOCK_N = 16  # the smallest N of a tl.dot
MIN_BLOCK_M = 16  # the smallest M of a tl.dot (and of an aligned block)
# measured: a 16-bit pipelined expand at BLOCK_M 64 with 8 warps allocated 4 KB beyond its
# tiles (every other compile of the sweep: none); added to every expand, as a bound
EXPAND_SCRATCH = 4096


def stage_bytes(block_m: int, tiles: GemmTiles, parts: int, elem: int) -> int:
    """Shared memory of one GEMM pipeline stage (docs/kernels.md)."""
    return (block_m * tiles.block_k + parts * tiles.block_k * tiles.block_n) * elem


def expand_bytes(
    block_m: int, block_n: int, lanes: int, parts: int, elem: int, pipelined: bool
) -> int:
    """Shared memory of the in-GEMM LoRA expand with `lanes` K lanes per dot (docs/kernels.md)."""
    if elem == 4 or pipelined:
        return parts * lanes * (block_m + block_n) * 4 + EXPAND_SCRATCH
    return parts * lanes * block_n * elem + block_m * lanes * 4 + EXPAND_SCRATCH


def shrink_bytes(cfg: TileConfig, parts: int, elem: int, rank: int) -> int:
    """Shared memory of the LoRA shrink of `parts` parts at `rank` (docs/kernels.md)."""
    block_m = shrink_tile_rows(cfg.shrink_block_m)
    block_r = shrink_rank_block(parts, rank, whole=cfg.lora_delta and cfg.shrink_expand)
    lanes = shrink_parts_per_program(parts, block_r) * block_r  # as lora_shrink packs
    copies = SHRINK_STAGES - 1 if elem == 4 else SHRINK_STAGES
    total = copies * (block_m + lanes) * cfg.shrink_block_k * elem
    if cfg.lora_delta and cfg.shrink_expand:
        total += lanes * (block_m + EXPAND_BLOCK_N) * 4
    return total


def dot_lanes(cfg: TileConfig, rank: int, num_slots: int) -> int:
    """K lanes of one expand dot, as the GEMM launchers size it."""
    return expand_dot_lanes(rank, num_slots, cfg.expand_lanes)


def fit_tiles(block_m: int, tiles: GemmTiles, parts: int, elem: int, limit: int) -> GemmTiles:
    """Fewer stages (down to 1), then half the BLOCK_K (down to 16), until the pipeline's
    stages fit `limit` bytes; tiles that fit come back unchanged."""
    while tiles.num_stages * stage_bytes(block_m, tiles, parts, elem) > limit - MARGIN:
        if tiles.num_stages > 1:
            tiles = dataclasses.replace(tiles, num_stages=tiles.num_stages - 1)
        elif tiles.block_k > MIN_BLOCK_K:
            tiles = dataclasses.replace(tiles, block_k=tiles.block_k // 2)
        else:
            break  # nothing left to shrink: launched as is (Triton reports the overflow)
    return tiles


def fit_expand(
    cfg: TileConfig, parts: int, elem: int, limit: int, rank: int, num_slots: int
) -> TileConfig:
    """cfg with the in-GEMM expand of both GEMMs fitted to `limit` bytes: fewer slots per
    dot, then expand_first off (16-bit), then half the BLOCK_N of a GEMM that does not fit;
    a cfg that fits comes back unchanged."""
    block_r = rank_block(rank)
    while True:
        lanes = dot_lanes(cfg, rank, num_slots)
        over = _expand_over(cfg, parts, elem, limit, lanes)
        if not over:
            return cfg
        if lanes > block_r:  # more than one slot per dot
            cfg = dataclasses.replace(cfg, expand_lanes=lanes // 2)
        elif cfg.expand_first and elem < 4:
            cfg = dataclasses.replace(cfg, expand_first=False)
        else:
            wide = {n: getattr(cfg, n) for n in over if getattr(cfg, n).block_n > MIN_BLOCK_N}
            if not wide:  # the [BLOCK_M, lanes] intermediates alone are too big
                if cfg.block_m <= MIN_BLOCK_M:
                    return cfg  # nothing left to shrink: launched as is (Triton reports it)
                cfg = dataclasses.replace(cfg, block_m=cfg.block_m // 2)
                continue
            halved = {n: dataclasses.replace(t, block_n=t.block_n // 2) for n, t in wide.items()}
            cfg = dataclasses.replace(cfg, **halved)


def _expand_over(cfg: TileConfig, parts: int, elem: int, limit: int, lanes: int) -> list[str]:
    """The GEMMs ("up", "down") whose expand does not fit `limit` bytes."""
    return [
        name
        for name, p in (("up", parts), ("down", 1))
        if expand_bytes(cfg.block_m, getattr(cfg, name).block_n, lanes, p, elem, cfg.expand_first)
        > limit - MARGIN
    ]


def fit_shrink(cfg: TileConfig, parts: int, elem: int, limit: int, rank: int) -> TileConfig:
    """cfg with half the shrink_block_k (down to 16) until the LoRA shrink fits `limit`."""
    while shrink_bytes(cfg, parts, elem, rank) > limit - MARGIN:
        if cfg.shrink_block_k <= MIN_BLOCK_K:
            break  # nothing left to shrink: launched as is (Triton reports the overflow)
        cfg = dataclasses.replace(cfg, shrink_block_k=cfg.shrink_block_k // 2)
    return cfg


def fit_config(
    cfg: TileConfig,
    parts: int,
    elem: int,
    limit: int,
    tma: bool,
    *,
    rank: int = 0,
    num_slots: int = 0,
) -> TileConfig:
    """cfg with every phase fitted to `limit` bytes of shared memory (docs/kernels.md:
    the expand and the shrink only with LoRA, rank > 0, of `num_slots` slots) and the TMA
    knobs off unless `tma`; the decode path (single-stage GEMV tiles) is left as is."""
    if cfg.decode:
        return cfg
    if rank > 0:
        if num_slots < 1:
            raise ValueError(
                f"num_slots: got {num_slots} with rank={rank}, expected the LoRA bank's "
                "slot count (>= 1); pass lora.num_slots"
            )
        cfg = fit_expand(cfg, parts, elem, limit, rank, num_slots)
        cfg = fit_shrink(cfg, parts, elem, limit, rank)
    fitted = dataclasses.replace(
        cfg,
        up=fit_tiles(cfg.block_m, cfg.up, parts, elem, limit),
        down=fit_tiles(cfg.block_m, cfg.down, 1, elem, limit),
    )
    if not tma:
        fitted = dataclasses.replace(fitted, up_tma=False, down_tma=False)
    return fitted


def fit_to_device(
    cfg: TileConfig,
    parts: int,
    dtype: torch.dtype,
    limits: GpuLimits | None,
    *,
    rank: int = 0,
    num_slots: int = 0,
) -> TileConfig:
    """cfg fitted to a GPU of `limits` (docs/kernels.md); unchanged without one (None: the
    interpreter, off CUDA). rank, num_slots: the LoRA bank's (the B factors' rank, its
    slots); 0 without LoRA. Called on every forward: computed once per (config, GPU)."""
    if limits is None:
        return cfg
    return _fitted(cfg, parts, dtype.itemsize, limits.shared_memory, limits.tma, rank, num_slots)


@functools.lru_cache(maxsize=4096)
def _fitted(
    cfg: TileConfig, parts: int, elem: int, limit: int, tma: bool, rank: int, num_slots: int
) -> TileConfig:
    # below sm_90 (and on ROCm): no TMA; every phase fitted with the same model (an upper
    # bound there: docs/kernels.md)
    return fit_config(cfg, parts, elem, limit, tma=tma, rank=rank, num_slots=num_slots)
