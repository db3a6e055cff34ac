"""What a load reports: where its weights came from (LoadOrigin), which slot it wrote and what
that cost (Placement, SlotWrite), and the counters a server exports (ServingStats).

SlotWrite is an int (the slot, as load() and replace() always returned) that also carries
the placement, the adapter evicted for it, the origin and the time taken.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType


class LoadOrigin(str, enum.Enum):
    """Where a load's weights came from."""

    HOST = "host"  # the host cache: parsed before (pinned, in the bank dtype, on CUDA)
    DISK = "disk"  # a PEFT directory, read and validated by this load
    MEMORY = "memory"  # an Adapter the caller holds (given to load, replace or register)


class Placement(str, enum.Enum):
    """Which slot a load wrote, and what it cost the other adapters."""

    FREE = "free"  # a slot no adapter held
    IN_PLACE = "in_place"  # the name's own slot, rewritten (a replace no forward held)
    EVICTED = "evicted"  # the least recently used adapter's slot: that one is unloaded
    NOT_LOADED = "not_loaded"  # replace of a registered name in no slot: catalog only


class SlotWrite(int):
    """The slot a load or replace wrote (an int; -1 when no slot was written), plus how it
    was chosen (`placement`), the adapter `evicted` for it (EVICTED only), where the
    weights came from (`origin`) and the seconds the call took (`seconds`)."""

    placement: Placement
    evicted: str | None
    origin: LoadOrigin | None
    seconds: float

    def __new__(
        cls,
        slot: int,
        placement: Placement,
        evicted: str | None = None,
        origin: LoadOrigin | None = None,
        seconds: float = 0.0,
    ) -> SlotWrite:
        obj = super().__new__(cls, slot)
        obj.placement, obj.evicted, obj.origin, obj.seconds = placement, evicted, origin, seconds
        return obj

    @property
    def slot(self) -> int:
        return int(self)

    def __repr__(self) -> str:
        evicted = f", evicted={self.evicted!r}" if self.evicted else ""
        origin = f", origin={self.origin.value!r}" if self.origin else ""
        return f"SlotWrite(slot={int(self)}, placement={self.placement.value!r}{evicted}{origin})"


@dataclass(frozen=True)
class ServingStats:
    """Counters since the SlotManager was built; `stats()` returns a consistent copy.

    Every slot load is counted once in `loads` (by origin); `misses` of them were made by
    reading() for a name in no slot, the other `explicit_loads` by load() / replace():
    sum(loads.values()) == misses + explicit_loads.
    """

    requests: int = 0  # reading() calls that got their lease
    refused: int = 0  # reading() calls refused: unknown name, too many names, a bad file
    hits: int = 0  # distinct names of a request already in a slot (not loaded by it)
    misses: int = 0  # names a request loaded into a slot itself
    explicit_loads: int = 0
    loads: Mapping[str, int] = field(default_factory=dict)  # origin -> slot loads
    load_seconds: Mapping[str, float] = field(default_factory=dict)  # origin -> summed time
    write_seconds: float = 0.0  # of that, the slot writes (host-to-device copies)
    evictions: int = 0  # adapters unloaded to make room
    in_place: int = 0  # replaces that rewrote the name's own slot
    host_hits: int = 0  # reads served by the host cache
    host_misses: int = 0  # reads from a directory or a held Adapter into the cache
    host_evictions: int = 0
    host_adapters: int = 0  # adapters in the host cache now (at most host_capacity)
    host_bytes: int = 0
    host_capacity: int = 0  # max_cpu_loras
    registered: int = 0

    def as_dict(self) -> dict:
        """Plain values (the mappings as dicts), e.g. for JSON or a metrics exporter."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return out | {"loads": dict(self.loads), "load_seconds": dict(self.load_seconds)}


class LoadTally:
    """The mutable counters behind ServingStats; the SlotManager updates them under its
    lock."""

    def __init__(self) -> None:
        self.requests = self.refused = self.hits = self.misses = 0
        self.explicit_loads = self.evictions = self.in_place = 0
        self.loads: Counter[str] = Counter()
        self.load_seconds: Counter[str] = Counter()
        self.write_seconds = 0.0

    def record(self, write: SlotWrite, write_s: float, *, demand: bool) -> None:
        assert write.origin is not None
        self.loads[write.origin.value] += 1
        self.load_seconds[write.origin.value] += write.seconds
        self.write_seconds += write_s
        self.evictions += write.placement is Placement.EVICTED
        self.in_place += write.placement is Placement.IN_PLACE
        if demand:
            self.misses += 1
        else:
            self.explicit_loads += 1

    def freeze(self, **host: int) -> ServingStats:
        return ServingStats(
            requests=self.requests,
            refused=self.refused,
            hits=self.hits,
            misses=self.misses,
            explicit_loads=self.explicit_loads,
            loads=MappingProxyType(dict(self.loads)),
            load_seconds=MappingProxyType(dict(self.load_seconds)),
            write_seconds=self.write_seconds,
            evictions=self.evictions,
            in_place=self.in_place,
            **host,
        )
