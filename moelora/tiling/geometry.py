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


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length()


def rank_block(rank: int) -> int:
    """BLOCK_R: the K lanes one adapter's rank takes in a dot (a power of two, at least
    16, the smallest dot)."""
    return max(16, next_pow2(rank))


def shrink_parts_per_program(parts: int, block_r: int) -> int:
    """Parts one shrink program computes: both while their lanes stay within 64 fp32
    registers per row, else one."""
    return parts if parts * block_r <= 64 else 1


def slots_per_dot(num_slots: int, block_r: int, lanes: int) -> int:
    """Slots one expand dot covers: as many as fit `lanes` K lanes (a power of two, at least
    one slot, at most the slots there are)."""
    fit = 1
    while fit * 2 * block_r <= lanes:
        fit *= 2
    return min(fit, next_pow2(max(1, num_slots)))
