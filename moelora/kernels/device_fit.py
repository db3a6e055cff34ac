"""Fit a picked tile config to the GPU that runs it.

The committed H200 table and the heuristics size their GEMM pipelines for 16-bit inputs
on Hopper (228 KB of shared memory per block, TMA). Elsewhere the same config can fail at
launch: fp32 inputs double every stage (the T >= 1024 rows then need 384 KB), an A100 has
164 KB, an L40S 99 KB, and TMA copies are sm_90+. So a config that `pick_config` returned
is fitted here before launch: pipeline stages dropped (then BLOCK_K halved) until the
stages fit the device's shared memory, and the TMA knobs turned off below sm_90. A config a
caller passes explicitly (the tune, a test) is launched as given.

Shared memory of one GEMM pipeline stage: the row tile [BLOCK_M, BLOCK_K] and `parts`
weight tiles [BLOCK_K, BLOCK_N] (the gated up GEMM loads its gate and up tiles), in the
input's element size. This is what Triton allocated for the H200 rows (benchmarks/
lora_cost.py at afe8054: up 128 x (2 x 128) x 64, 4 stages, bf16: 196608 bytes; down
128 x 256 x 64, 4 stages: 196640, the 32 more its TMA barriers), hence a margin of 1 KB.
Elsewhere the model is an upper bound, not a measurement: Triton 3.9's sm_90 compile (no
GPU) of the fp32 up kernel at 3 stages allocates 196608 bytes where it counts 294912, so
fp32 and smaller GPUs may get fewer stages than they could hold (slower; none of this has
run on such a GPU yet). Not fitted: the LoRA shrink's 3 stages (rank 128 in fp32 at large T may exceed
a GPU's shared memory; not yet measured).
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
def _device_limits(index: int) -> tuple[int, bool]:
    """(shared memory bytes per block, TMA available) of CUDA device `index`."""
    import triton

    props = triton.runtime.driver.active.utils.get_device_properties(index)
    tma = not torch.version.hip and torch.cuda.get_device_capability(index)[0] >= 9
    return int(props["max_shared_mem"]), tma


def fit_to_device(cfg: TileConfig, parts: int, dtype: torch.dtype, device: torch.device):
    """cfg fitted to `device` (module docstring); unchanged off CUDA (the interpreter)."""
    if device.type != "cuda":
        return cfg
    index = device.index if device.index is not None else torch.cuda.current_device()
    limit, tma = _device_limits(index)
    return fit_config(cfg, parts, dtype.itemsize, limit, tma)
