"""Fit a picked tile config to the GPU that runs it.

The committed H200 table and the heuristics size their kernels for 16-bit inputs on
Hopper (227 KB of shared memory per block, TMA) and LoRA rank 16 (the tune's bank).
Adjustments, to a config that `pick_config` returned (a config a caller passes
explicitly, as the tune and the tests do, is launched as given):
- TMA copies are sm_90+: below that the TMA knobs (up_tma, down_tma) are turned off.
- On sm_90+, each kernel's largest shared-memory phase (below) is fitted to the device's
  shared memory less MARGIN: fp32 inputs double every pipeline stage (the stage model
  counts 384 KB for the up GEMM of the T >= 1024 H200 rows), and with LoRA (rank > 0) the
  in-GEMM expand's operand tiles grow with the rank (fp32 rank 128: 256 KB in the up GEMM
  of the T >= 4096 rows at any number of stages).

Triton gives each phase of a kernel its shared memory and reuses it for the next, so a
kernel needs its largest phase. The phases, per block, each checked against Triton 3.9
sm_90 compiles of the launches the forward makes (arguments specialised as at launch) at
BLOCK_M 16-128, BLOCK_N 32-256, BLOCK_K 16-128, 1-4 stages, rank 16-128, 1-8 slots per
expand dot, expand_first on / off, 4 / 8 warps, half tails, TMA on / off, bf16 / fp16 /
fp32 (fp16 allocated what bf16 did in every case):
- GEMM pipeline (stage_bytes): the row tile [BLOCK_M, BLOCK_K] and `parts` weight tiles
  [BLOCK_K, BLOCK_N] (the gated up GEMM loads its gate and up tiles) per stage, in the
  input's element size. What Triton 3.6 allocated for the H200 rows in bf16
  (benchmarks/lora_cost.py at afe8054: up 128 x (2 x 128) x 64, 4 stages: 196608 bytes;
  down 128 x 256 x 64: 196640, the 32 more its TMA barriers, hence MARGIN; Triton 3.9:
  the same, 196672 with the up TMA). An upper bound in fp32, where Triton 3.9 keeps
  num_stages - 1 copies without TMA (the up kernel at 3 stages: 196608 bytes where it
  counts 294912), so fp32 may get fewer stages than it could hold.
- LoRA expand (expand_bytes): per part, the intermediate [BLOCK_M, Q] and the B tile
  [Q, BLOCK_N], Q the expand dot's K lanes (the rank rounded up to a power of two, at
  least 16, times the slots one dot covers), as fp32 where the dots are fp32 (IEEE) or
  the expand is pipelined (expand_first: its loads run ahead in shared memory). Equal to
  every fp32 compile where it reached 64 KB, and to the 16-bit pipelined ones at
  BLOCK_M >= 64 (4 KB more at 8 warps: EXPAND_SCRATCH, added to every expand). 16-bit
  without expand_first: the B tiles in the input's dtype and one fp32 intermediate, an
  upper bound (at most 2x what was allocated at Q >= 64).
- LoRA shrink (shrink_bytes): SHRINK_STAGES stages of the input rows [shrink BLOCK_M,
  shrink_block_k] and the A tile [shrink_block_k, lanes] (lanes: the rank's, or both
  parts' where they fit 64, as the shrink launcher packs them), in the input's element
  size; one stage fewer in fp32 (every fp32 shrink compile held SHRINK_STAGES - 1, every
  16-bit one at most SHRINK_STAGES). The expanding shrink (lora_delta with shrink_expand)
  adds its expand's fp32 tiles [shrink BLOCK_M + EXPAND_BLOCK_N, lanes] (the sum bounded
  every compile).
- Epilogue scratch (the output tile's layout conversion): at most 32 KB measured, so
  never the phase that decides at the limits fitted to; not modelled.

Order of the reductions, each only while its phase does not fit:
1. the expand, whose tiles no pipeline knob shrinks: fewer slots per expand dot (halve
   expand_lanes while a dot covers more than one slot; the H200 tune measured 8 slots per
   dot 1.3-1.6x slower than 2 at T >= 1024: configs.py), then expand_first off (16-bit
   only, where the non-pipelined expand holds less; measured 3% faster at T = 4096 only
   at rank 16, and off is the default path), then half the BLOCK_N of each GEMM that does
   not fit (down to 16, the smallest dot; twice the programs, each reading its rows
   again), and last half the BLOCK_M (down to 16), whose [BLOCK_M, lanes] intermediates
   are all that is left (fp32 at rank 128 on a 99 KB GPU);
2. the GEMM pipelines, with that BLOCK_N: fewer stages (down to 1), then half the BLOCK_K
   (down to 16);
3. the shrink: half its shrink_block_k (down to 16); its stages are not a config knob.
Configs with lora_delta are fitted as if the GEMMs expanded (fully sharded LoRA ignores
lora_delta, and the fit does not know the layout). Without LoRA (rank 0) only the
pipelines are fitted, as before. On the H200 in 16-bit every picked config stays as it is
up to rank 64 with 1-32 slots; at rank 128 the Qwen3 T >= 4096 rows turn expand_first
off (their pipelined expand: 262144 bytes in the up GEMM's compile).

Below sm_90 (TMA off there) the same model is applied. Triton multi-buffers these loops
there too once a launch's divisibility hints are in (sm_80 compiles of the Qwen3 T = 4096
row allocate 147456 bytes in bf16 at rank 16, against an L40S's 101376; sm_80 / 89 ones at
rank 128 196608 in bf16 and 294912 in fp32), and holds one stage fewer than counted
without the TMA (147456 for 4 counted stages of 49152), so the model is an upper bound
there. Compiled after fitting (Triton 3.9, 8 slots), every GEMM and shrink launch fits:
for sm_80 at the A100's limit, the H200 T = 4096 LoRA row at rank 128 in bf16 (largest
phase 98304 bytes) and fp32 (147456); for sm_89 at the L40S's limit, the BLOCK_M 128
heuristic at rank 16 in bf16 (49152) and at rank 128 in fp32 (98304; BLOCK_M halved to
64 by the last expand lever, 147456 in the up GEMM before it). Ranks
above 128: an expand that does not fit at BLOCK_M 16 is launched as is (Triton reports
it). None of this has run on a GPU below sm_90; tests/test_device_fit.py compiles the
fitted worst cases for sm_90.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
import triton

from .configs import GemmTiles, TileConfig
from .lora_shrink import EXPAND_BLOCK_N, lora_shrink
from .tiles import rank_block, shrink_parts_per_program, slots_per_dot

MARGIN = 1024  # bytes kept free per block: barriers and small scratch besides the phases
MIN_BLOCK_K = 16  # the smallest K of a tl.dot
MIN_BLOCK_N = 16  # the smallest N of a tl.dot
MIN_BLOCK_M = 16  # the smallest M of a tl.dot (and of an aligned block)
# measured: a 16-bit pipelined expand at BLOCK_M 64 with 8 warps allocated 4 KB beyond its
# tiles (every other compile of the sweep: none); added to every expand, as a bound
EXPAND_SCRATCH = 4096
# the stages the forward launches the LoRA shrink with (the launcher's default: moe_lora
# passes none), read from the launcher so that the two cannot drift apart
SHRINK_STAGES = inspect.signature(lora_shrink).parameters["num_stages"].default


def stage_bytes(block_m: int, tiles: GemmTiles, parts: int, elem: int) -> int:
    """Shared memory of one GEMM pipeline stage (module docstring)."""
    return (block_m * tiles.block_k + parts * tiles.block_k * tiles.block_n) * elem


def expand_bytes(
    block_m: int, block_n: int, lanes: int, parts: int, elem: int, pipelined: bool
) -> int:
    """Shared memory of the in-GEMM LoRA expand with `lanes` K lanes per dot (module
    docstring)."""
    if elem == 4 or pipelined:
        return parts * lanes * (block_m + block_n) * 4 + EXPAND_SCRATCH
    return parts * lanes * block_n * elem + block_m * lanes * 4 + EXPAND_SCRATCH


def shrink_bytes(cfg: TileConfig, parts: int, elem: int, rank: int) -> int:
    """Shared memory of the LoRA shrink of `parts` parts at `rank` (module docstring)."""
    block_m = max(16, triton.next_power_of_2(cfg.shrink_block_m))
    block_r = rank_block(rank)
    lanes = shrink_parts_per_program(parts, block_r) * block_r  # as lora_shrink packs
    copies = SHRINK_STAGES - 1 if elem == 4 else SHRINK_STAGES
    total = copies * (block_m + lanes) * cfg.shrink_block_k * elem
    if cfg.lora_delta and cfg.shrink_expand:
        total += lanes * (block_m + EXPAND_BLOCK_N) * 4
    return total


def expand_dot_lanes(cfg: TileConfig, rank: int, num_slots: int) -> int:
    """K lanes of one expand dot, as the GEMM launchers size it."""
    block_r = rank_block(rank)
    return block_r * slots_per_dot(num_slots, block_r, cfg.expand_lanes)


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
        lanes = expand_dot_lanes(cfg, rank, num_slots)
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
    """cfg with every phase fitted to `limit` bytes of shared memory (module docstring:
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


@functools.cache
def _device_limits(index: int) -> tuple[int, int]:
    """(shared memory bytes per block, compute capability major) of CUDA device `index`
    (ROCm: major 0, i.e. no TMA)."""
    props = triton.runtime.driver.active.utils.get_device_properties(index)
    major = 0 if torch.version.hip else torch.cuda.get_device_capability(index)[0]
    return int(props["max_shared_mem"]), major


def fit_to_device(
    cfg: TileConfig,
    parts: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    rank: int = 0,
    num_slots: int = 0,
) -> TileConfig:
    """cfg fitted to `device` (module docstring); unchanged off CUDA (the interpreter).
    rank, num_slots: the LoRA bank's (the B factors' rank, its slots); 0 without LoRA.
    Called on every forward: the fitted config is computed once per (config, device)."""
    if device.type != "cuda":
        return cfg
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _fitted(cfg, parts, dtype.itemsize, *_device_limits(index), rank, num_slots)


@functools.lru_cache(maxsize=4096)
def _fitted(
    cfg: TileConfig, parts: int, elem: int, limit: int, major: int, rank: int, num_slots: int
) -> TileConfig:
    # below sm_90 (and on ROCm): no TMA; every phase fitted with the same model (module
    # docstring: an upper bound there)
    return fit_config(cfg, parts, elem, limit, tma=major >= 9, rank=rank, num_slots=num_slots)
