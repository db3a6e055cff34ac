"""The tile configuration of one forward of the `triton` backend: data only.

A `TileConfig` fixes every size and knob the kernels launch with; what each knob does
and when the table uses it is in docs/kernels.md ("Tile configurations"). Where a
config comes from (the H200 table, the heuristic) is `tiling.pick`; how it is fitted to
the GPU is `tiling.fit`; what a forward derives from it is `tiling.plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum


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
    expand_one_dot: bool = False  # 16-bit: each LoRA expand one dot of t rounded to x's dtype


class Gemm(Enum):
    """What a knob acts on."""

    UP = "up"  # the up GEMM (w13 with its LoRA expand)
    DOWN = "down"  # the down GEMM (w2 with its LoRA expand)
    BOTH = "both"  # both expert GEMMs
    LORA = "lora"  # the LoRA shrink / expand kernels
    LAYER = "layer"  # the forward's path (which kernels run, and how they chain)


class Search(Enum):
    """How benchmarks/tune.py searches a knob (docs/history/kernel_log.md v7)."""

    LORA = "lora"  # with LoRA, after the tiles: each of `values` in turn
    DELTA = "delta"  # with lora_delta only (alone a no-op): every on/off combination
    LAYOUT = "layout"  # both modes: flipped, kept when faster; written to a row only when on
    DECODE = "decode"  # the decode path's own search
    NONE = "none"  # not searched: the TileConfig default everywhere


@dataclass(frozen=True)
class Knob:
    """One TileConfig knob, declared once: the values a table row may hold and the tune
    tries, whether it acts only with LoRA (a LoRA-free row setting it is malformed), what
    it acts on, whether it switches a code path (docs/kernels.md lists each such knob with
    the table rows that set it), and how the tune searches it."""

    name: str
    values: tuple
    lora_only: bool
    gemm: Gemm
    path: bool
    search: Search


# Every knob of TileConfig but the tiles themselves. The order is the tune's search order
# (searched()), and its code-path knobs' order is the one docs/kernels.md explains them in.
# Values: the tune's candidates (the decode shrink's: (A rows, BLOCK_K) per program).
KNOB_SPECS: tuple[Knob, ...] = (
    Knob("decode", (False, True), False, Gemm.LAYER, True, Search.DECODE),
    Knob("pdl", (False, True), False, Gemm.LAYER, True, Search.DECODE),
    Knob("expand_lanes", (16, 32, 64), True, Gemm.BOTH, False, Search.LORA),
    Knob("shrink_block_m", (16, 32, 64), True, Gemm.LORA, False, Search.LORA),
    Knob("shrink_split_k", (1, 2, 4, 8), True, Gemm.LORA, False, Search.LORA),
    Knob("lora_delta", (False, True), True, Gemm.LORA, True, Search.LORA),
    Knob("delta_in_reduce", (False, True), True, Gemm.DOWN, True, Search.DELTA),
    Knob("shrink_expand", (False, True), True, Gemm.LORA, True, Search.DELTA),
    Knob("expand_first", (False, True), True, Gemm.BOTH, True, Search.LORA),
    Knob("half_tail", (0, 1, 2, 3), False, Gemm.BOTH, True, Search.LAYOUT),  # bit 1 up, 2 down
    Knob("z_sorted", (False, True), False, Gemm.BOTH, True, Search.LAYOUT),
    Knob("down_tma", (False, True), False, Gemm.DOWN, True, Search.LAYOUT),
    Knob("up_tma", (False, True), False, Gemm.UP, True, Search.LAYOUT),
    Knob("atomic_reduce", (False, True), False, Gemm.DOWN, True, Search.LAYOUT),
    Knob("lora_stream", (False, True), True, Gemm.LAYER, True, Search.LORA),
    # every LoRA expand (in both GEMMs, the delta kernel, the shrink_expand; kernels/tiles.py,
    # expand_dot); H200 A/B at 5a2d445: -2..-3.5% at T = 4096, within noise elsewhere
    Knob("expand_one_dot", (False, True), True, Gemm.LORA, True, Search.LORA),
    Knob("shrink_block_k", (128,), True, Gemm.LORA, False, Search.NONE),
    Knob("group_m", (8,), False, Gemm.BOTH, False, Search.NONE),
    Knob(
        "decode_shrink",
        ((2, 1024), (1, 2048), (2, 2048), (4, 512), (4, 1024), (8, 256)),
        True,
        Gemm.LORA,
        False,
        Search.DECODE,
    ),
)
KNOB = {k.name: k for k in KNOB_SPECS}
# The knobs a table row may set, with their types (every TileConfig field but the tiles).
KNOBS: dict[str, type] = {
    f.name: type(f.default) for f in fields(TileConfig) if f.name not in ("block_m", "up", "down")
}
assert KNOB.keys() == KNOBS.keys(), "each TileConfig knob has one Knob spec"
# The knobs that act only with LoRA (a LoRA-free row setting one is malformed).
LORA_KNOBS = frozenset(k.name for k in KNOB_SPECS if k.lora_only)
# The knobs that switch a code path, in the order docs/kernels.md explains them.
PATH_KNOBS = tuple(k.name for k in KNOB_SPECS if k.path)


def searched(search: Search) -> dict[str, tuple]:
    """name -> the tune's candidate values, for the knobs searched that way (spec order)."""
    return {k.name: k.values for k in KNOB_SPECS if k.search is search}
