"""What block-scaled FP8 experts ask of a tile config: no TMA weight tiles (their boxes
are sized for 2-byte elements) and BLOCK_K steps that never straddle a scale block along K
(the K loops, GEMM and decode GEMV alike, read one scale per step)."""

from __future__ import annotations

import dataclasses

from .config import GemmTiles, TileConfig


def _step_in_block(tiles: GemmTiles, block_k: int) -> GemmTiles:
    """tiles with BLOCK_K halved until it divides the scale block's K side (>= 16)."""
    step = tiles.block_k
    while block_k % step and step > 16:
        step //= 2
    return dataclasses.replace(tiles, block_k=step)


def fit_to_fp8_blocks(cfg: TileConfig, scale_block: tuple[int, int]) -> TileConfig:
    """cfg for e4m3 experts with block scales of scale_block [bn, bk] (unchanged otherwise)."""
    bk = scale_block[1]
    return dataclasses.replace(
        cfg,
        up_tma=False,
        down_tma=False,
        up=_step_in_block(cfg.up, bk),
        down=_step_in_block(cfg.down, bk),
    )
