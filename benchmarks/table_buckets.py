"""Which T bucket a tuned row takes in the tile table (benchmarks/tune.py).

A table key is (E, K, H, I, LoRA on, upper bound): a row serves every T above the next
smaller bound of its shape and mode, up to its own. A row records the T it was measured at
(moelora.tiling.table.TableRow.tuned_at). Tuned T that fall in a committed bucket measured at another T
split that bucket at the geometric means of neighbouring T (the tuned ones and the row's
own), so each row keeps serving the T it was measured at (tuning T = 16384 once replaced
the T = 4096 row whose bucket ran to infinity, leaving T = 4096 on a row it was never
timed at). Every key is fixed before tuning starts, so the order the T are tuned in does
not matter. Without a committed bucket, a tuned T takes the bound from its neighbours
among the tuned T.

Only REFERENCE-class rows (moelora/tiling/lora_class.py) are split; a row of another LoRA
class takes the T range of the REFERENCE-class bucket holding its tuned T (`class_bucket`), so a
class tuned at a few T gets predictable ranges, with gaps where nothing holds them.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

from moelora.tiling.lora_class import REFERENCE, LoRAClass
from moelora.tiling.table import TableRow


class Buckets:
    """The table of one tune run: committed rows (all shapes, by key), with the
    keys of every tuned T of this shape fixed up front (any tuning order gives the same
    keys). In each committed bucket the anchors are the tuned T that fall in it plus the
    T its row was measured at (when not re-tuned); each anchor's bound is the geometric
    mean with the next anchor, the largest keeps the bucket's bound, and the committed row
    moves to its anchor's bound. Tuned T in no committed bucket take bounds from their
    neighbours among those T. Only the buckets of `modes` (the modes this run re-tunes at
    the REFERENCE class) are split: a mode not re-tuned keeps its rows as committed."""

    def __init__(
        self,
        dims: tuple,
        table: dict[tuple, TableRow],
        tuned: list[int],
        commit: str,
        modes: tuple[bool, ...] = (False, True),
    ):
        self.dims, self.commit = dims, commit
        self.table = dict(table)
        self._ups = {
            on: sorted(
                r.max_tokens
                for r in table.values()
                if r.shape == dims and r.lora == on and r.lora_class == REFERENCE
            )
            for on in (False, True)
        }
        self._keys: dict[tuple[int, bool], tuple] = {}
        for on in modes:
            self._assign(sorted(set(tuned)), on)

    def containing(self, t: int, on: bool) -> tuple | None:
        """The key the committed table (before this run) had for T's bucket, else None."""
        u = next((u for u in self._ups[on] if t <= u), None)
        return None if u is None else (*self.dims, on, u)

    def key(self, t: int, on: bool) -> tuple:
        return self._keys[(t, on)]

    def class_bucket(self, t: int, lora_class: LoRAClass) -> tuple[tuple, int] | None:
        """(key, tokens.from) of the LoRA row of `lora_class` tuned at T: the T range of the
        committed REFERENCE-class LoRA bucket holding T (before this run's splits); None
        when this shape has no such row (tune the REFERENCE class first)."""
        ups = self._ups[True]
        i = bisect.bisect_left(ups, t)
        if i == len(ups):
            return None
        return (*self.dims, True, ups[i], lora_class), ups[i - 1] + 1 if i else 1

    def _assign(self, tuned: list[int], on: bool) -> None:
        lower, placed = 0, set()
        for up in self._ups[on]:
            inside = [t for t in tuned if lower < t <= up]
            if inside:
                self._split((*self.dims, on, up), lower, inside)
                placed.update(inside)
            lower = up
        rest = [t for t in tuned if t not in placed]
        for i, t in enumerate(rest):
            bound = 2**31 - 1 if i + 1 == len(rest) else math.isqrt(t * rest[i + 1])
            self._keys[(t, on)] = (*self.dims, on, bound)

    def _split(self, key: tuple, lower: int, inside: list[int]) -> None:
        """Bounds for the tuned T inside the committed bucket `key` (lower, key[5]], and the
        committed row's move when it keeps serving its own T below another anchor."""
        old = self.table[key].tuned_at
        keep_old = old is not None and lower < old <= key[5] and old not in inside
        anchors = sorted(set(inside) | ({old} if keep_old else set()))
        for i, a in enumerate(anchors):
            bound = key[5] if i + 1 == len(anchors) else math.isqrt(a * anchors[i + 1])
            moved = (*key[:5], bound)
            if a in inside:
                self._keys[(a, key[4])] = moved
            elif moved != key:  # the committed row, below a larger tuned T
                row = self.table.pop(key)
                split = f"bucket split at T={bound} by the {self.commit} run"
                note = "; ".join(n for n in (row.note, split) if n)
                self.table[moved] = dataclasses.replace(row, max_tokens=bound, note=note)
