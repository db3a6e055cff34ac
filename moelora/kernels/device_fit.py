"""Fit a picked tile config to the GPU that runs it.

The committed H200 table and the heuristics size their GEMM pipelines for 16-bit inputs on
Hopper (227 KB of shared memory per block, TMA). Two adjustments, to a config that
`pick_config` returned (a config a caller passes explicitly, as the tune and the tests do,
is launched as given):
- TMA copies are sm_90+: below that the TMA knobs (up_tma, down_tma) are turned off.
- On sm_90+, fp32 inputs double every pipeline stage (the stage model below counts 384 KB
  for the up GEMM of the T >= 1024 H200 rows): stages are dropped, then BLOCK_K halved,
  until the stages fit the device's shared memory.

Shared memory of one GEMM pipeline stage: the row tile [BLOCK_M, BLOCK_K] and `parts`
weight tiles [BLOCK_K, BLOCK_N] (the gated up GEMM loads its gate and up tiles), in the
input's element size. This is what Triton 3.6 allocated for the H200 rows in bf16
(benchmarks/lora_cost.py at afe8054: up 128 x (2 x 128) x 64, 4 stages: 196608 bytes;
down 128 x 256 x 64, 4 stages: 196640, the 32 more its TMA barriers), hence a margin of
1 KB. For fp32 it is an upper bound (Triton 3.9's sm_90 compile of the fp32 up kernel at 3
stages allocates 196608 bytes where it counts 294912), so fp32 may get fewer stages than
it could hold.

Not covered, and so not claimed (a review compiled the fitted configs for sm_80 / 89 / 90
with Triton 3.9): the LoRA expand's operand tiles, which at rank 128 in fp32 overflow the
H200's shared memory at T >= 4096 even at 1 stage (262144 bytes); the LoRA shrink's three
stages; and GPUs below sm_90, where Triton does not multi-buffer these loops and the same
configs fit as they are in 16-bit, so their stages are left alone. None of this has run on
such a GPU yet.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .configs import GemmTiles, TileConfig

MARGIN = 1024  # bytes kept free per block: barriers and small scratch besides the stages
MIN_BLOCK_K = 16  # the smallest K of a tl.dot


def stage_bytes(block_m: int, tiles: GemmTiles, parts: int, elem: int) -> int:
    """Shared memory of one pipeline stage (module docstring)."""
    return (block_m * tiles.block_k + parts * tiles.block_k * tiles.block_n) * elem


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


def fit_config(cfg: TileConfig, parts: int, elem: int, limit: int, tma: bool) -> TileConfig:
    """cfg with both GEMMs' pipelines fitted to `limit` bytes of shared memory and the TMA
    knobs off unless `tma`; the decode path (single-stage GEMV tiles) is left as is."""
    if cfg.decode:
        return cfg
    fitted = dataclasses.replace(
        cfg,
        up=fit_tiles(cfg.block_m, cfg.up, parts, elem, limit),
        down=fit_tiles(cfg.block_m, cfg.down, 1, elem, limit),
    )
    if not tma:
        fitted = dataclasses.replace(fitted, up_tma=False, down_tma=False)
    return fitted


@functools.cache
def _device_limits(index: int) -> tuple[int, int]:
    """(shared memory bytes per block, compute capability major) of CUDA device `index`
    (ROCm: major 0, i.e. no TMA and no stage fitting)."""
    import triton

    props = triton.runtime.driver.active.utils.get_device_properties(index)
    major = 0 if torch.version.hip else torch.cuda.get_device_capability(index)[0]
    return int(props["max_shared_mem"]), major


def fit_to_device(cfg: TileConfig, parts: int, dtype: torch.dtype, device: torch.device):
    """cfg fitted to `device` (module docstring); unchanged off CUDA (the interpreter).
    Called on every forward: the fitted config is computed once per (config, device)."""
    if device.type != "cuda":
        return cfg
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _fitted(cfg, parts, dtype.itemsize, *_device_limits(index))


@functools.lru_cache(maxsize=4096)
def _fitted(cfg: TileConfig, parts: int, elem: int, limit: int, major: int) -> TileConfig:
    if major < 9:  # no TMA; stages left alone (module docstring)
        return dataclasses.replace(cfg, up_tma=False, down_tma=False)
    return fit_config(cfg, parts, elem, limit, tma=True)
