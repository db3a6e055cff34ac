"""Which T bucket a tuned row takes in the tile table (benchmarks/tune.py).

A table key is (E, K, H, I, LoRA on, upper bound): a row serves every T above the next
smaller bound of its shape and mode, up to its own. A row's comment says at which T it was
measured ("T=4096: ..."). A tuned T that falls in a committed bucket measured at another T
splits that bucket at the geometric mean of the two T, so each row keeps serving the T it
was measured at (tuning T = 16384 once replaced the T = 4096 row whose bucket ran to
infinity, leaving T = 4096 on a row it was never timed at). Without a committed bucket, a
tuned T takes the bound from its neighbours among the tuned T.
"""

from __future__ import annotations

import math
import re

_TUNED_AT = re.compile(r"T=(\d+):")


def tuned_at(note: str) -> int | None:
    """The T a committed row was measured at, from its comment ("T=4096: ..."), else None."""
    m = _TUNED_AT.match(note)
    return int(m.group(1)) if m else None


class Buckets:
    """The table of one tune run: committed rows (all shapes) and their notes, re-keyed as
    tuned T split their buckets. `key(t, on)` is stable within a run."""

    def __init__(self, dims: tuple, table: dict, notes: dict, tuned: list[int], commit: str):
        self.dims, self.commit = dims, commit
        self.table, self.notes = dict(table), dict(notes)
        ordered = sorted(tuned)
        self._bound = {
            t: (2**31 - 1 if i + 1 == len(ordered) else math.isqrt(t * ordered[i + 1]))
            for i, t in enumerate(ordered)
        }
        self._keys: dict[tuple[int, bool], tuple] = {}

    def committed(self, on: bool) -> dict:
        """This shape's rows of one mode (after any splits)."""
        return {k: r for k, r in self.table.items() if k[:4] == self.dims and k[4] == on}

    def containing(self, t: int, on: bool) -> tuple | None:
        """The key of this shape's committed bucket that T falls in, else None."""
        ups = sorted(k[5] for k in self.committed(on))
        u = next((u for u in ups if t <= u), None)
        return None if u is None else (*self.dims, on, u)

    def key(self, t: int, on: bool) -> tuple:
        if (t, on) not in self._keys:
            self._keys[(t, on)] = self._assign(t, on)
        return self._keys[(t, on)]

    def _assign(self, t: int, on: bool) -> tuple:
        key = self.containing(t, on)
        if key is None:
            return (*self.dims, on, self._bound[t])
        old = tuned_at(self.notes.get(key, ""))
        lower = max((k[5] for k in self.committed(on) if k[5] < key[5]), default=0)
        if old is None or old == t or not lower < old <= key[5]:
            return key
        split = math.isqrt(old * t)  # old <= split < t, or t <= split < old
        if old > t:
            return (*self.dims, on, split)  # the new row takes the lower part
        moved = (*self.dims, on, split)  # the committed row takes the lower part
        self.table[moved] = self.table.pop(key)
        note = self.notes.pop(key, "kept from the committed table")
        self.notes[moved] = f"{note}; bucket split at T={split} by the {self.commit} run"
        return key
