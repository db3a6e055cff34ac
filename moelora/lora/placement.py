"""Which slot a load writes: one pure decision over the current map, the leased slots, the
pins and the LRU clock (the SlotManager applies it under its lock, or waits and asks again).

Order (none of them costs another adapter until the last):
1. the name's own slot when no lease holds it (a replace, rewritten in place);
2. a slot in no map and no lease;
3. the slot of the least recently used adapter that is not pinned, not `name`, not named
   by the same batch (`keep`) and not leased: that adapter is evicted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError
from .reports import Placement


@dataclass(frozen=True)
class Choice:
    slot: int
    placement: Placement
    evicted: str | None = None


def choose_slot(
    name: str,
    slot_of: Mapping[str, int],
    busy: Mapping[int, int],
    num_slots: int,
    *,
    pinned: set[str],
    keep: frozenset[str],
    last_used: Mapping[str, int],
) -> Choice | None:
    """The slot for `name`'s new weights, or None when only a lease ending can free one.
    Raises ConfigError when no lease ending would help (every other slot pinned or kept)."""
    own = slot_of.get(name)
    if own is not None and own not in busy:
        return Choice(own, Placement.IN_PLACE)
    mapped = set(slot_of.values())
    free = [s for s in range(num_slots) if s not in mapped and s not in busy]
    if free:
        return Choice(free[0], Placement.FREE)
    spared = pinned | keep | {name}
    candidates = [n for n in slot_of if n not in spared]
    if not candidates and len(mapped) == num_slots and own is None:
        raise ConfigError(
            "num_slots",
            num_slots,
            f"a free slot or an unpinned adapter to evict ({len(pinned)} pinned"
            + (f", {len(keep)} named by this batch)" if keep else ")"),
            "unpin or unload an adapter, or raise num_slots",
        )
    evictable = [n for n in candidates if slot_of[n] not in busy]
    if not evictable:
        return None
    victim = min(evictable, key=lambda n: last_used.get(n, -1))
    return Choice(slot_of[victim], Placement.EVICTED, victim)
