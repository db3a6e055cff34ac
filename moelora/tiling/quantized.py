"""What FP8 experts (W8A8) ask of a tile config: no TMA weight tiles (their boxes are
sized for 2-byte elements); for block scales, BLOCK_K equal to the scale block's K side in
the GEMMs (a step reads one activation group's scale per row and one weight scale per
column) and in the decode GEMVs whose programs' rows straddle scale blocks; a GEMV whose
rows share one scale block keeps its picked step (the scales then act on the input's
columns, kernels/fp8_tiles.py). The inputs arrive quantized (kernels/quant_rows.py), so the
pipeline's stages are refitted to the shared memory for e4m3 tiles on both sides."""

from __future__ import annotations

import dataclasses

from ..errors import ConfigError
from ..quantization import FP8_MAX_STEP, FP8_MIN_STEP, QuantConfig
from .config import GemmTiles, TileConfig
from .fit import MARGIN
from .geometry import gate_up_rows, rows_share_scale_block

# The FP8 GEMM tiles from BLOCK_M 64 up (the bf16 rows there hold two fp32 accumulators of
# [128, 128] plus each K step's scaled product: benchmarks/fp8_sweep.py on the H200 at
# 56979e1, Qwen3-30B-A3B +LoRA, T = 4096: the bf16 row refitted 3.198 ms, these 1.131)
LARGE_M = 64
LARGE_UP = GemmTiles(64, 128, 4, 3)
LARGE_DOWN = GemmTiles(128, 128, 4, 3)
# A decode GEMV step other than one scale block loads two scales per column (the input's
# group, the rows' block) for every pair of the program: the down GEMV keeps such a step
# only from this many rows per program, where those loads are at most a quarter of the
# weight loads (a reasoned bound, not a sweep: on the H200 at 1d0ea3b its 2-row programs
# over 256 columns took 16.9 us at T = 1 against 9.8 us with one-block steps at 5a2d445).
# The up GEMV's programs read 2 x BLOCK_N rows per x column (gate and up, each with its own
# block scale), and its widest measured step won at 4 rows (T = 1: 14.8 us, 0.074 -> 0.047
# ms for the layer), so it keeps its step at any BLOCK_N.
COLUMN_ROWS = 8
# A K step of the FP8 dot (quantization.py): 32 to 256; the fit below keeps a
# [BLOCK_M, 256] x tile in shared memory at BLOCK_M 128.
MIN_STEP, MAX_STEP = FP8_MIN_STEP, FP8_MAX_STEP


def fp8_pipeline_bytes(block_m: int, tiles: GemmTiles, parts: int) -> int:
    """Shared memory of an FP8 GEMM's K loop, as Triton's sm_90 compile allocates it
    (measured on the up GEMM at BLOCK_M 64 and 128, 2-4 stages: exact): an e4m3 input tile
    and `parts` e4m3 weight tiles per stage."""
    k = tiles.block_k
    return tiles.num_stages * (block_m * k + parts * k * tiles.block_n)


def _step_is_block(
    block_m: int, tiles: GemmTiles, block_k: int, parts: int, limit: int | None
) -> GemmTiles:
    """tiles with BLOCK_K = block_k and, under a shared-memory `limit`, fewer stages (down
    to 1) until the pipeline fits (the decode GEMVs hold no pipeline in shared memory)."""
    tiles = dataclasses.replace(tiles, block_k=block_k)
    while (
        limit is not None
        and tiles.num_stages > 1
        and fp8_pipeline_bytes(block_m, tiles, parts) > limit - MARGIN
    ):
        tiles = dataclasses.replace(tiles, num_stages=tiles.num_stages - 1)
    return tiles


def _gemm_step(cfg: TileConfig, tiles: GemmTiles) -> int:
    """A per-channel K loop's BLOCK_K: the picked one, at least MIN_STEP in the GEMMs (the
    e4m3 tensor-core dot needs K >= 32; the decode GEMVs multiply in fp32 registers)."""
    return tiles.block_k if cfg.decode else max(tiles.block_k, MIN_STEP)


def fit_to_fp8(
    cfg: TileConfig,
    quant: QuantConfig,
    *,
    parts: int = 2,
    shared_memory: int | None = None,
    inter: int | None = None,
    interleaved: bool = False,
) -> TileConfig:
    """cfg for e4m3 experts in `quant`'s format (W8A8): no TMA; FP8_BLOCK: BLOCK_K = bk (a
    bk the K loop cannot step by is refused, naming the checkpoint's key), except in a
    decode GEMV whose programs' rows share a scale block (it keeps the picked BLOCK_K: the
    scales act on the input's columns); FP8_CHANNEL: the picked BLOCK_K, at least MIN_STEP
    in the GEMMs (the activation scale spans the row). parts: w13's row parts per program
    (2 gated), shared_memory: the GPU's per-block bytes (None: no refit, the interpreter),
    inter / interleaved: w13's gate / up row layout (geometry.gate_up_rows; None: unknown,
    and every decode GEMV steps one scale block)."""
    group = quant.activation_group
    if group is not None and (group & (group - 1) or not MIN_STEP <= group <= MAX_STEP):
        raise ConfigError(
            "quantization_config.weight_block_size",
            list(quant.block),
            f"a K side (second value) that is a power of two in [{MIN_STEP}, {MAX_STEP}] "
            "(the triton kernels step K by one scale block)",
            "serve this checkpoint with the reference backend, or re-quantize it with "
            "128x128 blocks",
        )
    limit = None if cfg.decode else shared_memory
    if not cfg.decode and cfg.block_m >= LARGE_M:
        cfg = dataclasses.replace(cfg, block_m=LARGE_M, up=LARGE_UP, down=LARGE_DOWN)
    up_step = down_step = group
    if cfg.decode and group is not None and inter is not None:  # rows sharing a scale row
        rows = gate_up_rows(parts, interleaved, inter)
        if rows_share_scale_block(cfg.up.block_n, *rows, quant.block[0]):
            up_step = cfg.up.block_k
        down = cfg.down.block_n
        if down >= COLUMN_ROWS and rows_share_scale_block(down, 1, 0, quant.block[0]):
            down_step = cfg.down.block_k
    return dataclasses.replace(
        cfg,
        up_tma=False,
        down_tma=False,
        up=_step_is_block(cfg.block_m, cfg.up, up_step or _gemm_step(cfg, cfg.up), parts, limit),
        down=_step_is_block(
            cfg.block_m, cfg.down, down_step or _gemm_step(cfg, cfg.down), 1, limit
        ),
    )
