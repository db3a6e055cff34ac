"""The adapter lifecycle: public name -> version -> slot. One `AdapterRegistry` beside the
SlotManager holds every loaded name's current `Version`, its pin, and the holds callers take.

Each load of a name is a new version with its own slot-manager key, so a reader keeps the
version it started with while loads, replaces and unloads go on: `hold(names)` takes one
slot lease over the current versions of every name (a registered version in no slot is
loaded first) and returns one `AdapterHold` per name, with host slot ints. A refused load
changes nothing: the new version is written before it is published, and the old one is
retired only once the new one is in (the slot manager frees its slot when the last lease
on it ends). Legend: L slots (num_slots), R max rank (max_rank).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from .adapter import Adapter
from .leases import BankSnapshot
from .reports import ServingStats
from .slots import SlotManager

log = logging.getLogger("moelora.lora")


@dataclass(frozen=True)
class Version:
    """One load of one adapter name: its slot-manager key, whether it has expert factors,
    its largest rank, the served modules it has factors on, and its pin."""

    name: str
    key: str
    experts: bool
    rank: int
    modules: frozenset[str]
    pinned: bool


@dataclass(frozen=True)
class AdapterHold:
    """One version held for a row (None: the base model): its slot (-1: none) and the banks
    its slot indexes, until release() (exactly once; the lease ends with the last hold of a
    hold() call)."""

    version: Version | None
    slot: int
    snapshot: BankSnapshot
    release: Callable[[], None]

    @property
    def key(self) -> str | None:
        return None if self.version is None else self.version.key

    @property
    def experts(self) -> bool:
        return self.version is not None and self.version.experts

    @property
    def modules(self) -> frozenset[str]:
        return frozenset() if self.version is None else self.version.modules


class AdapterRegistry:
    """Public names over one SlotManager (see the module doc). Thread-safe."""

    def __init__(self, manager: SlotManager) -> None:
        self.manager = manager
        self._versions: dict[str, Version] = {}
        self._lock = threading.Lock()  # writers, and the start of every hold
        self._seq = itertools.count()

    # ---- facts ------------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """The loaded names, sorted."""
        return sorted(self._versions)

    def version(self, name: str | None) -> Version | None:
        """The current version of `name` (None: the base model, or a name not loaded)."""
        return None if name is None else self._versions.get(name)

    def require(self, name: str) -> Version:
        """The current version of a loaded name; InputError naming the loaded ones."""
        version = self._versions.get(name)
        if version is None:
            raise InputError(
                "adapter name", repr(name), f"None or a loaded adapter {self.names} (load it first)"
            )
        return version

    @property
    def lora_modules(self) -> frozenset[str]:
        """The served modules some loaded version has factors on."""
        return frozenset().union(*(v.modules for v in list(self._versions.values())))

    @property
    def pinned(self) -> frozenset[str]:
        return frozenset(n for n, v in list(self._versions.items()) if v.pinned)

    def describe(self, name: str) -> dict[str, Any]:
        v = self.require(name)
        return {"name": name, "rank": v.rank, "experts": v.experts, "pinned": v.pinned,
                "modules": sorted(v.modules)}  # fmt: skip

    def stats(self) -> ServingStats:
        """The slot manager's counters (copies into slots, evictions, host cache, ...)."""
        return self.manager.stats()

    # ---- the lifecycle ------------------------------------------------------------------------

    def publish(self, name: str, adapter: Adapter, pin: bool | None = None) -> Version:
        """Make `adapter` (checked, parsed: expert layers and module factors) the current
        version of `name`; a loaded name is replaced (holders keep the old version).
        pin: keep it in its slot; None: a replacement keeps the replaced version's pin, a
        new name is not pinned. Refused: nothing changes."""
        if not isinstance(name, str) or not name:
            raise InputError("name", repr(name), "a non-empty adapter name")
        key = f"moelora{next(self._seq)}"
        with self._lock:
            old = self._versions.get(name)
            rank = max([adapter.rank, *(m.rank for m in adapter.modules.values())])
            version = Version(
                name, key, experts=bool(adapter.layers), rank=rank,
                modules=frozenset(adapter.modules), pinned=self._pin_for(name, old, pin),
            )  # fmt: skip
            self._replace(old, version, dataclasses.replace(adapter, name=key))
        return version

    def unload(self, name: str) -> None:
        """Unload `name`; holders keep its version until they release it."""
        with self._lock:
            version = self.require(name)
            del self._versions[name]
            self.manager.unregister(version.key)

    def unpin(self, name: str) -> None:
        """Let `name` be evicted from its slot again (no-op when it is not pinned)."""
        with self._lock:
            version = self.require(name)
            self.manager.unpin(version.key)
            self._versions[name] = dataclasses.replace(version, pinned=False)

    def _pin_for(self, name: str, old: Version | None, pin: bool | None) -> bool:
        if pin is not None:
            return pin
        if old is not None and old.pinned:
            log.info("adapter %s: the replacement keeps the pin (unpin(%r) drops it)", name, name)
            return True
        return False

    def _replace(self, old: Version | None, version: Version, adapter: Adapter) -> None:
        """Under the lock: write `version`, then publish it and retire `old`. A pinned old
        version is unpinned during the write (with every slot full, its slot may be the one
        the new version takes); if the write fails it is pinned again, still in its slot."""
        repin = old is not None and old.pinned
        if repin:
            self.manager.unpin(old.key)
        try:
            self._write(version, adapter)
        except BaseException:
            if repin and old.key in self.manager.loaded:
                self.manager.pin(old.key)
            raise
        self._versions[version.name] = version
        if old is not None:
            self.manager.unregister(old.key)

    def _write(self, version: Version, adapter: Adapter) -> None:
        """Register the version (a hold naming it copies it into a slot if it is in none)
        and load it now when a slot is free or it is pinned. On failure it is unregistered."""
        manager = self.manager
        try:
            held = manager.register(version.key, adapter)  # its host form: loaded from it
            if version.pinned or len(manager.loaded) < manager.num_slots:
                manager.load(held, name=version.key, pin=version.pinned)
        except BaseException:
            if version.key in manager.registered:
                manager.unregister(version.key)
            raise

    # ---- holds --------------------------------------------------------------------------------

    def hold(self, names: Sequence[str | None]) -> list[AdapterHold]:
        """Hold the current versions of all `names` (None: base model) at once: one slot
        lease over the set, as one forward takes it (callers that took them one by one could
        each hold a slot while waiting for another's). InputError for a name not loaded; the
        lease ends when every returned hold is released."""
        with self._lock:
            versions = [None if n is None else self.require(n) for n in names]
            lease = self.manager.lease([None if v is None else v.key for v in versions])
        left = [len(versions)]
        count_lock = threading.Lock()

        def releaser() -> Callable[[], None]:
            done = threading.Event()

            def release() -> None:
                if done.is_set():
                    return
                done.set()
                with count_lock:
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    lease.release()

            return release

        if not versions:
            lease.release()
        return [AdapterHold(v, slot, lease.snapshot, releaser())
                for v, slot in zip(versions, lease.slots)]  # fmt: skip
