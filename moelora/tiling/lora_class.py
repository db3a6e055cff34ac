"""The LoRA class of a bank: the (rank, slots) bucket the tile table's LoRA rows are keyed on.

The kernels' LoRA cost and shared memory grow with the tile rank (the largest real rank
loaded, `LoRABank.tile_rank`: the expand's dots and the shrink's accumulators) and with
the slots (the in-GEMM expand packs every slot's rank lanes into its dots), so tiles tuned
for 8 adapters of rank 16 are not those of 128 adapters or of rank 256. A bank's class
rounds both up to a grid of powers of two; the table may hold rows tuned at any class,
and a lookup takes the nearest tuned class (tiling/table.py, `Table.lookup`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError

# Grids: the ranks and slot counts users load (PEFT ranks 8-256, banks of 8 to 128+ slots).
# A value above the grid takes the top class (the kernels cap the expand at rank 256 and
# slots only enter a per-block loop, so the top class's tiles still fit there).
RANK_CLASSES = (16, 32, 64, 128, 256)
SLOT_CLASSES = (8, 16, 32, 64, 128)


def _bound(value: int, grid: tuple[int, ...], name: str) -> int:
    """The smallest member of `grid` >= value (the largest above it)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(name, value, "an integer >= 0", f"pass the LoRA bank's {name}")
    return next((g for g in grid if g >= value), grid[-1])


@dataclass(frozen=True, order=True)
class LoRAClass:
    """A (rank class, slot class) pair, members of RANK_CLASSES and SLOT_CLASSES."""

    rank: int
    slots: int

    def __post_init__(self) -> None:
        for name, grid in (("rank", RANK_CLASSES), ("slots", SLOT_CLASSES)):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in grid:
                raise ConfigError(
                    f"lora_class.{name}",
                    value,
                    f"one of {list(grid)}",
                    "use LoRAClass.of(tile_rank, num_slots) to round a bank to its class",
                )

    @classmethod
    def of(cls, tile_rank: int, num_slots: int) -> LoRAClass:
        """The class of a bank of `num_slots` slots whose largest real rank is `tile_rank`:
        each rounded up to its grid (0 to the smallest class, above it to the largest)."""
        return cls(
            _bound(tile_rank, RANK_CLASSES, "tile_rank"),
            _bound(num_slots, SLOT_CLASSES, "num_slots"),
        )

    def distance(self, other: LoRAClass) -> float:
        """|log2 of the rank ratio| + |log2 of the slots ratio|: grid steps between them."""
        return abs(math.log2(self.rank / other.rank)) + abs(math.log2(self.slots / other.slots))

    def preference(self, other: LoRAClass) -> tuple[float, int, int]:
        """How a lookup for this class ranks a tuned class `other` (smallest first): the
        nearest by distance; on a tie the larger rank class, then the larger slot class
        (a larger class's tiles were fitted for more shared memory, so they still fit)."""
        return (self.distance(other), -other.rank, -other.slots)

    def __str__(self) -> str:
        """'8x128': slots x rank, as the benchmarks name banks (8 adapters of rank 128)."""
        return f"{self.slots}x{self.rank}"


# The class every LoRA row tuned before classes existed was measured at: 8 adapters of rank
# 16 (benchmarks/tune.py's bank then). A row without a lora_class field is of this class.
REFERENCE = LoRAClass(16, 8)
