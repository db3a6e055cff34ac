"""Tile configurations per shape and token count (the only tuned constants of the kernels).

`pick_config` returns the committed H200 table's entry when one exists for the exact
(E, K, H, I, LoRA on, T bucket), else the heuristic below. Heuristic constants, and how chosen:
- BLOCK_M: the power of two >= 1.5 m, m = T*K/E expected pairs per expert (uniform
  routing; 1.5 covers the busier experts), from 16 (smallest tl.dot tile) to 128, so most
  experts fit one block and their weights are read once (see _heuristic).
- BLOCK_N / BLOCK_K: 64 x 128 for small m (weight streaming; 128-wide K loads = 256 B
  rows), 128 x 64 for large m (MMA-bound; the standard Hopper Triton matmul tile).
  Gated up kernels hold two accumulators, so their BLOCK_N is half the down kernel's.
- num_warps 4 / 8 and num_stages 3 / 4: Triton tutorial defaults for these tile sizes.
- BLOCK_M 128 (large m): up 128 x 64 and down 256 x 64 tiles, 8 warps, 4 stages, z in the
  sorted order with the down GEMM's tiles by TMA. Measured: every H200 tune row at
  T >= 1024 of two shapes, both modes, has these BLOCK_N x BLOCK_K tiles with 8 warps
  (Qwen3-30B-A3B, 976c808 / 543d834; Mixtral-8x7B, eda1eca), half of them with 3 stages
  in one GEMM or both, and with the old 64 x 64 / 128 x 64 heuristic tiles Mixtral-8x7B at
  T = 4096 +LoRA took 6.99 ms, slower than vLLM's 6.71, against 5.77 tuned (eda1eca run;
  BENCHMARKS.md). device_fit (kernels/device_fit.py) adapts them to the GPU that runs
  them (TMA, shared memory).
- shrink split-K (LoRA): 8 / 4 / 2 / 1 K chunks for P = T*K pairs <= 2048 / 8192 / 32768 /
  above, so the shrink grid reaches thousands of programs at small T while the fp32
  atomic traffic (P * S*R * 4 bytes per chunk) stays a few MB. Predicted from the v5
  numbers, then measured on the H200 against split 1 in one run (KERNEL_LOG.md v6: +LoRA
  T=64 0.375 vs 0.420 ms, 1024 0.641 vs 0.652, 4096 1.219 vs 1.226). Table rows that name
  their own split (the v7 tunes) override it.
- shrink tile rows (LoRA): a shrink tile is a run of one (expert, slot) bucket, m/L rows
  on average with m pairs per expert and L adapters in use; 16 rows (the smallest dot) up
  to m = 256, 32 up to 1024, then 64, so a bucket is one or two tiles at 8 adapters.
  Reasoned; the H200 tunes chose 16-64 per T (KERNEL_LOG.md v7).
- expand lanes (LoRA): 32 K lanes per expand dot (2 slots of rank 16). In the v7 tunes on
  the H200, 128 lanes (8 slots per dot) were 1.3-1.6x slower at T >= 1024 (idle lanes cost
  MMA and registers), 64 lost to 32 everywhere but T = 1024, and 16 and 32 each won at
  some T (table rows keep their own).
- decode: the decode path (GEMV kernels straight from the top-k ids: no alignment, no
  reduce launch) only where a table row measured it faster; off elsewhere. On the H200 it
  won at the Qwen3 shape (E = 128, K = 8) at T <= 4 with and without LoRA and T <= 8
  LoRA-free (bb19efa / d848c8e / d1f71a2 runs; at T = 4 with LoRA by 1%), and with PDL
  (below) at T <= 8 in both modes (0b04468 run), with the tiles tuned for that shape (the
  down tile alone moved it 2x). With those same tiles on other shapes it lost at T = 1
  with LoRA (Mixtral-8x7B 0.247 vs 0.224 ms, DeepSeek-V3 0.228 vs 0.205) and on
  gpt-oss-20b LoRA-free (0.095 vs 0.073): e95b043 run, KERNEL_LOG.md v9. DECODE_TILES is where the
  tune's decode search starts (the Qwen3 T = 1 choice).
- decode_shrink (LoRA, decode path): A rows x BLOCK_K per program of the x shrink; default
  2 x 1024 (4 KB per step, the whole A read in flight in two steps at T = 1), reasoned;
  the Qwen3 T = 1 tune chose 1 x 2048 (0.0420 vs 0.0429 ms for the layer, 7c66a6a run).
- pdl (decode path): off; the decode kernels after the layer's first are launched with
  programmatic dependent launch and load their first weight step before waiting for the
  kernel before (kernels/pdl.py). On the H200 the 0b04468 tune chose it at T = 1, 2, 4
  LoRA-free and T = 1..8 with LoRA (T = 1 with LoRA 0.0420 -> 0.0366 ms, LoRA-free 0.0343
  -> 0.0318); LoRA-free T = 8 kept it off. On the aligned path it launches the kernels
  with PDL, each waiting first (no early loads): within +-1.5% on the H200 (d6f8ea3, v13b),
  so no table row sets it there (tests/test_kernel_configs.py holds rows to that). Off in
  the interpreter, before compute capability 9.0, on ROCm and under fully sharded LoRA.
- lora_delta (LoRA): off; the expand runs over the (expert, slot) shrink tiles into a
  delta buffer the GEMM epilogues add, instead of mixed-slot dots inside the GEMMs
  (kernels/lora_delta.py). Off by default; the H200 table uses it at T = 1024 (76a0024
  tune: 0.5926 -> 0.5617 ms with z_sorted + TMA); ignored under fully sharded LoRA.
- delta_in_reduce (with lora_delta): off; the down delta is added by the top-k reduce (a
  streaming read, weighted there) instead of the down GEMM's epilogue, which then runs
  LoRA-free. Reasoned from the d1f71a2 profile (the epilogue load cost 0.030 ms at
  T = 1024 for 33.5 MB); H200 A/B with lora_delta at e65c412: 0.5612 -> 0.5409 ms at
  T = 1024, 1.133 -> 1.102 at 4096 (still slower there than the row without lora_delta),
  and the T = 1024 table row takes it.
- shrink_expand (with lora_delta): off; each shrink program expands its whole-K
  intermediate into the delta rows itself (no lora_delta launches, the intermediate never
  stored; the shrink runs unsplit). Reasoned (two launches and a round trip fewer, ~0.01
  ms at T = 1024 by the d1f71a2 profile); H200 A/B at e65c412 (with delta_in_reduce):
  slower at T = 1024 (0.5409 -> 0.5527 ms), faster at 4096 (1.102 -> 1.066) but still
  slower than that row without lora_delta (1.023); no table row takes it.
- z_sorted / down_tma: off. z stored in the sorted pair order (the down GEMM and the z
  shrink read contiguous rows instead of gathering them), and the down GEMM's z and w2
  tiles copied by the TMA (down_tma implies z_sorted; SGLang reports 10-40% on its down
  GEMM with both). CPU-tested, not yet measured here (KERNEL_LOG.md, "Next"), so off
  until a tune picks them.
- expand_first (LoRA, in-GEMM expand): off; the expand runs before the main K loop as
  its own software-pipelined loop (all its slot groups' loads issued ahead, no per-group
  skip) instead of after it. Reasoned from benchmarks/lora_cost.py on the H200 (afe8054):
  at T = 4096 one slot group per block already added 0.036 ms to the up GEMM, latency
  with one CTA per SM, not MMA. Same-run A/B: +LoRA 4096 1.0116 -> 0.9796 ms, 16384
  3.0066 -> 3.0039, 256 0.4432 -> 0.4695 (slower); the 543d834 knobs-only tune took it
  at T = 4096 and 16384.
- half_tail (both modes, aligned path; 1 the up GEMM, 2 the down GEMM, 3 both): 0; a
  block whose second half is all padding (an expert's last block) runs a half-height
  variant compiled into the same kernel, so its padding rows cost no MMA. Reasoned: at
  T = 4096 with 128-row blocks a quarter of the GEMM rows are padding under uniform
  routing (40960 for 32768 pairs; 36864 with half tails). Same-run A/B on the H200
  (543d834): LoRA-free 1024 0.3773 -> 0.3706 ms, 4096 0.7393 -> 0.7126, 16384 2.4963 ->
  2.3636; +LoRA 4096 1.0098 -> 0.9977, 16384 3.0195 -> 3.0627 (the down kernel with the
  LoRA expand spilled 18 registers with both variants). The knobs-only tunes chose 3 at
  T >= 256 LoRA-free and T = 256 / 1024 with LoRA, 1 (up only) at 4096 / 16384 with LoRA
  (543d834 and 976c808 runs).
  Needs BLOCK_M >= 32 (a half of 16 rows is below the smallest dot); ignored otherwise.
- up_tma: off; the up GEMM's w13 tiles copied by the TMA (gate rows and up rows as two
  [1, BLOCK_N, BLOCK_K] boxes; the interleaved swigluoai layout keeps pointer loads), as
  down_tma does for w2. Reasoned: the 8-warp up kernel ran at 255 registers (lora_cost,
  afe8054), and the TMA takes the weight addresses off the threads. Same-run A/B on the
  H200 (976c808): LoRA-free 4096 0.7171 -> 0.6990 ms, 1024 0.3694 -> 0.3688, 16384
  2.3947 -> 2.4422 (slower); +LoRA 4096 0.9587 -> 0.9339, 1024 0.5063 -> 0.5013, 16384
  2.8956 -> 2.9258 (slower). The knobs-only tune (976c808) took it at T = 1024 and 4096
  in both modes.
- atomic_reduce (both modes, aligned path): off; the down GEMM adds each pair's weighted
  row into an fp32 [T, H] sum with atomic adds, and a finishing pass writes the output
  (kernels/atomic_reduce.py), instead of writing o [P, H] for topk_reduce to read back.
  Reasoned from the v7 profile (topk_reduce 0.048 ms at T = 4096 for 134 MB of o read
  back, plus o's writes). Same-run A/B on the H200 (4aa3e56, two runs per side): faster
  at T = 256 (+LoRA 0.4379 / 0.4393 -> 0.4320 / 0.4316 ms, LoRA-free 0.3272 / 0.3280 ->
  0.3182 / 0.3180), level at 1024, slower at 4096 (+LoRA 0.935 -> 0.974) and 16384
  (2.84-3.05 -> 3.14-3.28): there the [T, H] fp32 sum (33 / 134 MB) competes for the
  50 MB L2 in which the adds resolve. The knobs-only tune (4aa3e56) took it at T = 16,
  64 and 256 in both modes (the atomic step alone: -1.0% at 256 +LoRA to -5.0% at 16
  LoRA-free); the Mixtral-8x7B tune (eda1eca) at T = 64 and 4096 LoRA-free, the latter
  on a 1.3% step inside that tune's spread, and a same-run A/B (770abbc, twice per side)
  measured it slower there (T = 4096 4.824 / 5.056 -> 5.121 / 5.120 ms, 16384 19.35 /
  19.38 -> 19.44 / 19.52), so that row has it off (the table's one hand edit, noted in
  its comment); DeepSeek-V3's T = 1 +LoRA row (770abbc tune) has it. The sum order
  varies between runs (fp32 atomics), so those rows are not bitwise repeatable.
  Ignored with lora_delta + delta_in_reduce (that reduce adds the delta rows).
GPU measurements that replace these land in H200_TABLE (see KERNEL_LOG.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .h200_table import H200_ROWS


@dataclass(frozen=True)
class GemmTiles:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    up: GemmTiles
    down: GemmTiles
    shrink_block_k: int = 128
    group_m: int = 8
    shrink_split_k: int = 1
    expand_lanes: int = 32
    z_sorted: bool = False
    down_tma: bool = False
    shrink_block_m: int = 16
    decode: bool = False  # the decode path (no alignment; up/down tiles are its GEMV tiles)
    decode_shrink: tuple[int, int] = (2, 1024)  # decode x shrink: (A rows, BLOCK_K) per program
    lora_delta: bool = False  # LoRA expand over the shrink tiles into a delta the GEMMs add
    delta_in_reduce: bool = False  # with lora_delta: the top-k reduce adds the down delta
    shrink_expand: bool = False  # with lora_delta: the shrink kernels expand (no split-K)
    pdl: bool = False  # PDL launches (decode path: first weight step loaded early; pdl.py)
    expand_first: bool = False  # LoRA: the in-GEMM expand as a pipelined loop before the K loop
    half_tail: int = 0  # 1 up, 2 down GEMM, 3 both: half-height blocks where half is padding
    up_tma: bool = False  # the up GEMM's w13 tiles by TMA (gate / up rows not interleaved)
    atomic_reduce: bool = False  # the down GEMM sums pairs into fp32 [T, H] (atomic_reduce.py)


def _from_row(row: tuple) -> TileConfig:
    block_m, up, down = row[:3]
    return TileConfig(block_m, GemmTiles(*up), GemmTiles(*down))


def _row_knobs(row: tuple) -> dict:
    """A row's measured knobs (its optional 4th element: LoRA shrink / expand knobs, z
    layout, TMA); knobs it does not name come from the rules below."""
    return dict(row[3]) if len(row) > 3 else {}


# (E, K, H, I, LoRA on, T bucket upper bound) -> TileConfig: measured on an H200 by
# benchmarks/tune.py (how, and each entry's measured gain, in h200_table.py).
H200_TABLE: dict[tuple[int, int, int, int, bool, int], TileConfig] = {
    key: _from_row(row) for key, row in H200_ROWS.items()
}
H200_KNOBS: dict[tuple[int, int, int, int, bool, int], dict] = {
    key: _row_knobs(row) for key, row in H200_ROWS.items()
}


def _heuristic(pairs_per_expert: float) -> TileConfig:
    # One block per expert where possible: below m ~ 184 (the H200 ridge) the layer is
    # weight-bandwidth bound, and every extra block of an expert re-reads its weights
    # (v1 used 32 rows at m = 64 and measured 2.3x the floor at T = 1024: KERNEL_LOG.md).
    block_m = 16
    while block_m < 128 and block_m < 1.5 * pairs_per_expert:
        block_m *= 2
    if block_m <= 32:
        return TileConfig(block_m, GemmTiles(64, 128), GemmTiles(64, 128))
    if block_m == 64:
        return TileConfig(64, GemmTiles(64, 64, 4, 4), GemmTiles(128, 64, 4, 4))
    return TileConfig(
        128, GemmTiles(128, 64, 8, 4), GemmTiles(256, 64, 8, 4), z_sorted=True, down_tma=True
    )


DECODE_TILES = TileConfig(
    16, GemmTiles(2, 2048, 4, 1), GemmTiles(2, 256, 4, 1), decode=True, decode_shrink=(1, 2048)
)


def _lora_heuristic(pairs_per_expert: float) -> TileConfig:
    # With LoRA, BLOCK_M also sets how many slots share a block, and the expand loops over
    # them with full-block dots. Below m = 48 smaller blocks measured faster on the H200
    # (KERNEL_LOG.md v1 vs v2: LoRA keeps v1's steps there); from m = 64 on, since the v7
    # shrink and expand, the LoRA-free tiles won (tune at T = 1024 / 4096 / 16384, v7).
    if pairs_per_expert >= 48:
        return _heuristic(pairs_per_expert)
    if pairs_per_expert < 24:
        return TileConfig(16, GemmTiles(64, 128), GemmTiles(64, 128))
    return TileConfig(32, GemmTiles(64, 128), GemmTiles(64, 128))


def _shrink_block_m(pairs_per_expert: float) -> int:
    """Rows of a LoRA shrink tile (module docstring: how chosen)."""
    for max_m, rows in ((256, 16), (1024, 32)):
        if pairs_per_expert < max_m:
            return rows
    return 64


def _shrink_split(pairs: int) -> int:
    """K chunks of the LoRA shrink (module docstring: how chosen)."""
    for max_pairs, split in ((2048, 8), (8192, 4), (32768, 2)):
        if pairs <= max_pairs:
            return split
    return 1


def aligned_config(cfg: TileConfig, num_tokens: int, num_experts: int, top_k: int, lora: bool):
    """cfg itself on the aligned path; for a decode cfg, the config the aligned path would
    take off the table (heuristic tiles, LoRA knobs from the rules): what the tune and the
    decode A/B compare against. (A decode row's own LoRA knobs are not tuned.)"""
    if not cfg.decode:
        return cfg
    return _off_table(num_tokens, num_experts, top_k, lora)


def _off_table(num_tokens: int, num_experts: int, top_k: int, lora: bool) -> TileConfig:
    """The heuristic config with the LoRA rules applied."""
    m = num_tokens * top_k / num_experts
    if not lora:
        return _heuristic(m)
    return dataclasses.replace(
        _lora_heuristic(m),
        shrink_split_k=_shrink_split(num_tokens * top_k),
        shrink_block_m=_shrink_block_m(m),
    )


def pick_config(
    num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, lora: bool = False
) -> TileConfig:
    """Tiles for one forward. Static per (shape, T): a CUDA graph per bucket sees one config."""
    for key, row in sorted(H200_TABLE.items(), key=lambda kv: kv[0][5]):
        if key[:5] == (num_experts, top_k, hidden, inter, lora) and num_tokens <= key[5]:
            if not lora:
                return dataclasses.replace(row, **H200_KNOBS[key])
            rules = dict(
                shrink_split_k=_shrink_split(num_tokens * top_k),
                shrink_block_m=_shrink_block_m(num_tokens * top_k / num_experts),
            )
            return dataclasses.replace(row, **{**rules, **H200_KNOBS[key]})
    return _off_table(num_tokens, num_experts, top_k, lora)
