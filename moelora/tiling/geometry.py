"""How a tile config's sizes become the kernels' lane counts: shared by the launchers
(moelora/kernels) and the device fit (tiling/fit.py), so that the fit models exactly
what the launchers launch. Plain integer arithmetic; no policy."""

from __future__ import annotations

# Columns per expand step when the LoRA shrink expands its own result (lora_delta with
# shrink_expand); reasoned, not tuned.
EXPAND_BLOCK_N = 64
# Pipeline stages the forward launches the LoRA shrink with (Triton's matmul-tutorial
# default for these tile sizes; not a config knob).
SHRINK_STAGES = 3


# A slot's width: its real rank rounded up to this (the smallest K of a 16-bit tl.dot),
# the columns its shrink computes and the kernels mask at.
RANK_STEP = 16


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length()


def rank_block(rank: int) -> int:
    """BLOCK_R: the K lanes one adapter's rank takes in a dot (a power of two, at least
    16, the smallest dot)."""
    return max(16, next_pow2(max(1, rank)))


def shrink_tile_rows(tile_m: int) -> int:
    """BLOCK_M of the kernels over the LoRA shrink tiles (the shrink, the delta expand): a
    tile's at most `tile_m` rows (>= 1) padded to a power of two, at least 16 (the smallest
    dot)."""
    return max(16, next_pow2(tile_m))


# fp32 accumulator lanes per row of one LoRA shrink program (both parts' rank chunks)
SHRINK_LANES = 64


def shrink_rank_block(parts: int, rank: int, whole: bool = False) -> int:
    """BLOCK_R of the LoRA shrink: the rank lanes of one part per program, for a bank keyed
    on `rank` (its tile rank). The whole rank_block(rank) when `whole` (the expanding shrink
    needs the whole intermediate); else at most SHRINK_LANES // parts (at least 16), the
    rank split into chunks over the grid, so a slot's programs stop at its real rank."""
    block_r = rank_block(rank)
    return block_r if whole else min(block_r, max(16, SHRINK_LANES // parts))


def shrink_parts_per_program(parts: int, block_r: int) -> int:
    """Parts one shrink program computes: both while their lanes stay within 64 fp32
    registers per row, else one."""
    return parts if parts * block_r <= SHRINK_LANES else 1


# Widest BLOCK_R of the in-GEMM expand: wider ranks run as passes of this many columns
# (rank 256 as one 256-lane dot took 8-9 ms at T = 256 / 4096 on the H200, 310c49a; the
# tiles were tuned at ranks up to 128).
EXPAND_MAX_BLOCK_R = 128


def expand_rank_block(tile_rank: int) -> int:
    """BLOCK_R of the in-GEMM expand (and the block the shrink fills its zeros up to) for a
    bank whose tile rank, the largest real rank loaded, is `tile_rank`."""
    return min(rank_block(tile_rank), EXPAND_MAX_BLOCK_R)


def expand_dot_lanes(rank: int, num_slots: int, lanes: int) -> int:
    """K lanes of one in-GEMM expand dot for a bank keyed on `rank` (its tile rank): the
    lanes of as many whole rank blocks as fit `lanes` (at least one)."""
    block_r = expand_rank_block(rank)
    return block_r * slots_per_dot(num_slots, block_r, lanes)


def slots_per_dot(num_slots: int, block_r: int, lanes: int) -> int:
    """Slots one expand dot covers: as many as fit `lanes` K lanes (a power of two, at least
    one slot, at most the slots there are)."""
    fit = 1
    while fit * 2 * block_r <= lanes:
        fit *= 2
    return min(fit, next_pow2(max(1, num_slots)))


def gate_up_rows(parts: int, interleaved: bool, inter: int) -> tuple[int, int]:
    """(row_step, up_offset) of w13's rows as the up GEMV reads them: parts 2 (gated) with
    gate / up rows interleaved (swigluoai): (2, 1); stacked: (1, inter); one part: (1, 0)
    (no up rows)."""
    if parts == 1:
        return 1, 0
    return (2, 1) if interleaved else (1, inter)


def rows_share_scale_block(block_n: int, row_step: int, up_offset: int, scale_n: int) -> bool:
    """Whether every weight row one decode GEMV program reads lies in one block-scale block
    of scale_n rows: its block_n rows, row_step apart from a multiple of block_n x row_step,
    and, for gated weights, the same rows shifted by up_offset (0: none). Then one scale
    per K block serves the whole program, and a K step may span several scale blocks
    (kernels/fp8_tiles.py: scaled_columns)."""
    span = block_n * row_step
    return scale_n % span == 0 and (up_offset % span == 0 or up_offset < row_step)
