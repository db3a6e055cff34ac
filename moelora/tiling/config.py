"""The tile configuration of one forward of the `triton` backend: data only.

A `TileConfig` fixes every size and knob the kernels launch with; what each knob does
and when the table uses it is in docs/kernels.md ("Tile configurations"). Where a
config comes from (the H200 table, the heuristic) is `tiling.pick`; how it is fitted to
the GPU is `tiling.fit`; what a forward derives from it is `tiling.plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class GemmTiles:
    """One GEMM's (or GEMV's, on the decode path) program tile and launch options."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class TileConfig:
    """Tiles and knobs of one forward (docs/kernels.md, "Tile configurations")."""

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
    lora_stream: bool = False  # LoRA: the down LoRA on a side stream beside the down GEMM


# The knobs a table row may set: every TileConfig field but the tiles themselves.
KNOBS: dict[str, type] = {
    f.name: type(f.default) for f in fields(TileConfig) if f.name not in ("block_m", "up", "down")
}
# The knobs that act only with LoRA (a LoRA-free row setting one is malformed).
LORA_KNOBS = frozenset(
    {
        "expand_lanes",
        "shrink_block_m",
        "shrink_split_k",
        "shrink_block_k",
        "lora_delta",
        "delta_in_reduce",
        "shrink_expand",
        "expand_first",
        "decode_shrink",
        "lora_stream",
    }
)
