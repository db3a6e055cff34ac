"""SlotManager: L adapter slots per MoE layer, loaded, replaced, unloaded, pinned and evicted,
and filled on demand from a catalog of registered adapters (more than there are slots).

Every MoE layer's bank is allocated once and written in place, one slot at a time. Forwards
read through a lease (`reading()`): the name -> slot map of one published version plus a
count on each slot it names, and a writer never writes a slot that is in the current map
or leased. A load therefore writes a free slot (or evicts an unleased LRU adapter first),
synchronizes, and only then publishes the map that names it: no forward sees a
half-written slot, and a forward keeps the adapters it started with until it releases the
lease. A replace rewrites the name's own slot when no forward holds it (the name unmapped
meanwhile; readers of it wait for the write), else writes another slot and moves the name.

Registered names (`register()`) are known without a slot: `reading()` loads one that is in
no slot from the host cache (catalog.py, host_cache.py), or reads it from its directory
into that cache, before taking its lease; readers whose names are all loaded never wait
for that. Legend: L slots, R max rank, E experts, S = 2 gated / 1 non-gated.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import torch

from ..config import ModelConfig
from ..errors import ConfigError, InputError, MoeloraError
from .adapter import Adapter, load_adapter
from .catalog import AdapterCatalog, Source
from .fits import check_fits
from .host_cache import HostCache, adapter_bytes
from .leases import BankSnapshot, SlotLeases
from .module_banks import ModuleBanks, ModuleShape
from .placement import choose_slot
from .reports import LoadOrigin, LoadTally, Placement, ServingStats, SlotWrite
from .slot_banks import SlotBanks

log = logging.getLogger("moelora.lora")

# A writer waiting for a slot is woken when a lease is released, but nothing wakes it when
# a released lease's CUDA event completes, so it polls. 5 ms (chosen, not measured): at most
# that much added to a load, which copies megabytes per layer anyway, without spinning.
_EVENT_POLL_S = 0.005


@dataclass
class Lease:
    """Slots held for readers (SlotManager.lease): the published version they read and one
    host slot per name (-1: base model). Until release() (on CUDA: until the work queued on
    the releasing thread's stream by then has run) no load, replace or unload writes them.
    release() once; a `with` block releases at its end."""

    snapshot: BankSnapshot
    slots: list[int]
    _release: object = field(repr=False)
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class SlotManager:
    """Owns the LoRA slot banks of every MoE layer of one model.

    load_timeout_s: how long a load waits for a slot no forward holds before raising.
    max_cpu_loras: how many registered adapters the host cache keeps parsed (default L).
    module_shapes: dense Linear modules (path -> ModuleShape) whose LoRA factors an adapter's
    `modules` may carry; their banks share the slots (and leases) of the expert banks.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        num_slots: int,
        max_rank: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        load_timeout_s: float = 30.0,
        max_cpu_loras: int | None = None,
        module_shapes: Mapping[str, ModuleShape] | None = None,
    ) -> None:
        if num_slots < 1:
            raise ConfigError("num_slots", num_slots, "a positive integer")
        if max_rank < 1:
            raise ConfigError("max_rank", max_rank, "a positive integer")
        if not load_timeout_s >= 0:
            raise ConfigError("load_timeout_s", load_timeout_s, "seconds >= 0")
        max_cpu_loras = num_slots if max_cpu_loras is None else max_cpu_loras
        if type(max_cpu_loras) is not int or max_cpu_loras < 0:  # bool is not a count
            raise ConfigError(
                "max_cpu_loras", max_cpu_loras, "an integer >= 0 (adapters kept in host memory)"
            )
        self.model_config, self.num_slots, self.max_rank = model_config, num_slots, max_rank
        self.load_timeout_s = load_timeout_s
        self._cond = threading.Condition()  # map, leases, LRU clock, pins, rewrites, tally
        self._write_lock = threading.Lock()  # one writer at a time; readers with hits never take it
        self._clock = itertools.count()
        self._last_used: dict[str, int] = {}
        self._pinned: set[str] = set()
        self._rewriting: set[str] = set()  # names unmapped while their own slot is rewritten
        self._leases = SlotLeases(num_slots)
        self._tally = LoadTally()
        dtype = dtype or model_config.shape.dtype
        self._slots = SlotBanks(model_config, num_slots, max_rank, device, dtype, module_shapes)
        self._banks = self._slots.banks
        cache = HostCache(max_cpu_loras, dtype, pin=self._slots.device.type == "cuda")
        self._catalog = AdapterCatalog(self._read_registered, cache)
        self._snapshot = BankSnapshot(0, self._banks, MappingProxyType({}))

    # ---- reading (any thread) ---------------------------------------------------------------

    @contextmanager
    def reading(
        self, names: Sequence[str | None], device: torch.device | str | None = None
    ) -> Iterator[tuple[BankSnapshot, torch.Tensor]]:
        """Lease the slots of `names` (None: base model) for a forward; yields (snapshot,
        token_slots [T] int32). Until the block exits (on CUDA: until the work queued on the
        current stream by then has run) no load, replace or unload writes those slots.

        A registered name in no slot is loaded first (this call waits for that, nobody
        else); a name neither loaded nor registered raises InputError, as does a batch of
        more distinct adapters than slots. Either failure changes nothing."""
        with self.lease(names) as lease:
            yield lease.snapshot, torch.tensor(lease.slots, dtype=torch.int32, device=device)

    def lease(self, names: Sequence[str | None]) -> Lease:
        """What reading() holds, as an object: the slots stay host ints (the caller copies
        them to the device once, with the rest of its step). Same loads and refusals."""
        snap, slots, held = self._lease(names)

        def release() -> None:
            event = self._slots.release_event() if held else None
            with self._cond:
                self._leases.release(held, event)
                self._cond.notify_all()

        return Lease(snap, slots, release)

    def snapshot(self) -> BankSnapshot:
        """The current version; reading one attribute is atomic, so no lock is needed."""
        return self._snapshot

    def token_slots(
        self, names: Sequence[str | None], device: torch.device | str | None = None
    ) -> tuple[BankSnapshot, torch.Tensor]:
        """(snapshot, token_slots [T] int32) consistent with each other; marks names used.
        Takes no lease and loads nothing: safe only while no load, replace or unload runs
        concurrently (a load may rewrite a slot this map names). Serving uses reading()."""
        with self._cond:
            snap = self._snapshot
            self._touch(names)
        return snap, snap.token_slots(names, device)

    @property
    def loaded(self) -> dict[str, int]:
        return dict(self._snapshot.slot_of)

    @property
    def registered(self) -> list[str]:
        return self._catalog.names()

    def stats(self) -> ServingStats:
        """The counters a server exports (reports.ServingStats), one consistent copy."""
        with self._cond:
            return self._tally.freeze(**self._catalog.cache.counts(), registered=len(self._catalog))

    # ---- the catalog (any thread) -------------------------------------------------------------

    def register(
        self,
        name: str,
        source: Adapter | str | Path,
        *,
        fused_orientation: str | None = None,
        serves_non_expert: bool = False,
    ) -> Adapter | None:
        """Know `name` without loading it: reading() loads it when a batch names it. A
        directory is read and validated at its first use (load_adapter's options apply).
        Returns the Adapter kept for an Adapter source (its host form), None for a path."""
        if isinstance(source, Adapter):
            self._check_fits(source)
            # held in its host form (bank dtype, pinned on CUDA), which the host cache then
            # reuses: a parsed adapter in fp32 beside a pinned copy was three times the bank
            # bytes per registered name (a 48-layer server of 32 names ran out of host memory)
            entry = Source(adapter=self._catalog.cache.convert(source))
        else:
            entry = Source(Path(source), None, fused_orientation, serves_non_expert)
        self._catalog.register(name, entry)
        return entry.adapter

    def unregister(self, name: str) -> None:
        """Forget a registered name and its host copy; unload it if it is in a slot."""
        with self._write_lock:
            self._catalog.unregister(name)
            if name in self._snapshot.slot_of:
                self._unload_locked(name)

    # ---- writing (one writer at a time) -------------------------------------------------------

    def load(
        self,
        adapter: Adapter | str | Path,
        *,
        name: str | None = None,
        pin: bool = False,
        fused_orientation: str | None = None,
        must_exist: bool = False,
        serves_non_expert: bool = False,
    ) -> SlotWrite:
        """Load an adapter into a slot no forward holds; returns its slot (a SlotWrite).

        Takes a free slot, else evicts the least recently used unpinned adapter whose slot
        is not leased; waits up to load_timeout_s for one. A name already loaded is replaced
        (see replace). Every check runs before any slot is touched: a failed load leaves
        every slot and the map as they were. A registered name now stands for these weights.
        """
        started = time.perf_counter()
        origin = LoadOrigin.MEMORY if isinstance(adapter, Adapter) else LoadOrigin.DISK
        source = None
        if not isinstance(adapter, Adapter):
            source = Source(Path(adapter), None, fused_orientation, serves_non_expert)
            adapter = load_adapter(
                adapter,
                self.model_config,
                self.max_rank,
                name=name,
                fused_orientation=fused_orientation,
                serves_non_expert=serves_non_expert,
                allocate=self.allocate_host,
            )
        name = name or adapter.name
        self._check_fits(adapter)
        if source is None:  # held in the form register() keeps (checked first: as given)
            adapter = self._catalog.cache.convert(adapter)
            source = Source(adapter=adapter)
        with self._write_lock:
            loaded = name in self._snapshot.slot_of  # only writers change it, and we are one
            if must_exist and not loaded and name not in self._catalog:
                raise InputError(
                    "adapter name", repr(name), f"a loaded adapter {sorted(self.loaded)}"
                )
            if must_exist and not loaded:  # registered, in no slot: the next read loads these
                self._catalog.update(name, source)
                seconds = time.perf_counter() - started
                return SlotWrite(-1, Placement.NOT_LOADED, None, origin, seconds)
            result = self._place(name, adapter, origin, started, pin=pin)
            self._catalog.update(name, source)  # only once the load has succeeded
            return result

    def replace(self, name: str, adapter: Adapter | str | Path) -> SlotWrite:
        """Swap the adapter behind a loaded (or registered) name; costs no other adapter.

        The name's own slot is rewritten in place when no forward holds it (placement
        IN_PLACE; the name is unmapped meanwhile and readers of it wait for the write). When
        a forward holds it, the new weights go to a free slot, else to the slot of an
        unleased LRU adapter (placement EVICTED, `evicted` names it), and the name moves
        there; forwards holding the old slot keep it until they end. A registered name in
        no slot only changes what the next reading() loads (slot -1, NOT_LOADED)."""
        return self.load(adapter, name=name, must_exist=True)

    def unload(self, name: str) -> None:
        """Free the adapter's slot: zeroed now if no forward holds it, else left as it is
        (named by no map) until the load that reuses it overwrites it in full. A registered
        name stays known: the next reading() naming it loads it again."""
        with self._write_lock:
            self._unload_locked(name)

    def leased(self) -> dict[int, int]:
        """slot -> leases open on it (or released with GPU work still queued): what no
        writer may touch now. Empty once every reader is done."""
        with self._cond:
            return dict(self._leases.busy())

    @property
    def pinned(self) -> frozenset[str]:
        with self._cond:
            return frozenset(self._pinned)

    def pin(self, name: str) -> None:
        """Never evict this adapter (it can still be unloaded or replaced explicitly)."""
        with self._cond:
            if name not in self._snapshot.slot_of:
                raise InputError(
                    "adapter name", repr(name), f"a loaded adapter {sorted(self.loaded)}"
                )
            self._pinned.add(name)

    def unpin(self, name: str) -> None:
        with self._cond:
            self._pinned.discard(name)

    @property
    def module_banks(self) -> ModuleBanks:
        """The dense Linear modules' banks (the same tensors for the manager's life)."""
        return self._slots.modules

    def _check_fits(self, adapter: Adapter) -> None:
        """Every check of an adapter's expert layers and dense modules, before any write."""
        check_fits(adapter, self.model_config, self.max_rank)
        self._slots.modules.check(adapter.path, adapter.modules)

    # ---- internals: on-demand loads -----------------------------------------------------------

    def _lease(self, names: Sequence[str | None]) -> tuple[BankSnapshot, list[int], frozenset]:
        """(snapshot, slots, leased slots) for `names`, loading registered names first."""
        wanted = frozenset(names) - {None}
        with self._cond:
            missing = self._await_rewrites(wanted)
            if not missing:
                return self._take(names, wanted, 0)
            self._check_servable(missing, wanted)
        try:
            # Read outside the write lock: a directory read does not hold up others' writes.
            fetched = {n: self._catalog.fetch(n) for n in sorted(missing)}
            with self._write_lock:  # now only this thread changes the map
                # Again: another request may have loaded some meanwhile, or evicted a name
                # that was loaded at the first look (that one is fetched now).
                missing = sorted(wanted - self._snapshot.slot_of.keys())
                for name in missing:
                    got = fetched.get(name)
                    if got is None or not self._catalog.is_current(name, got):
                        got = self._catalog.fetch(name)  # rare: evicted or replaced meanwhile
                    self._place(
                        name, got.adapter, got.origin, got.started, keep=wanted, demand=True
                    )
                with self._cond:
                    return self._take(names, wanted, len(missing))
        except MoeloraError:
            with self._cond:
                self._tally.refused += 1
            raise

    def _await_rewrites(self, wanted: frozenset[str]) -> frozenset[str]:
        """Under the lock: the wanted names in no slot, once none is being rewritten."""
        while True:
            missing = wanted - self._snapshot.slot_of.keys()
            if not missing & self._rewriting:
                return frozenset(missing)
            self._cond.wait()

    def _check_servable(self, missing: frozenset[str], wanted: frozenset[str]) -> None:
        """Under the lock: refuse (and count) a batch that no load can serve."""
        unknown = sorted(n for n in missing if n not in self._catalog)
        if unknown or len(wanted) > self.num_slots:
            self._tally.refused += 1
        if unknown:
            raise InputError(
                "adapter name",
                repr(unknown[0]),
                f"None, a loaded adapter {sorted(self._snapshot.slot_of)} or one of the "
                f"{len(self._catalog)} registered (register() it first)",
            )
        if len(wanted) > self.num_slots:
            raise InputError(
                "adapter names",
                f"{len(wanted)} distinct adapters in one batch",
                f"at most num_slots = {self.num_slots} (one slot each): split the batch",
            )

    def _take(self, names, wanted: frozenset[str], loaded: int):
        """Under the lock: lease the current map's slots for `names` and count the request."""
        snap = self._snapshot
        slots = snap.slots(names)
        held = frozenset(s for s in slots if s >= 0)
        self._leases.acquire(held)
        self._touch(names)
        self._tally.requests += 1
        self._tally.hits += len(wanted) - loaded
        return snap, slots, held

    def _read_registered(self, name: str, source: Source) -> Adapter:
        return load_adapter(
            source.path,
            self.model_config,
            self.max_rank,
            name=name,
            fused_orientation=source.fused_orientation,
            serves_non_expert=source.serves_non_expert,
            allocate=self.allocate_host,
        )

    def allocate_host(self, sizes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """Empty host tensors in the form this manager keeps adapters in (bank dtype, one
        pinned buffer on CUDA): load_adapter(allocate=...) parses into them directly."""
        return self._catalog.cache.allocate(sizes)

    # ---- internals: slots ---------------------------------------------------------------------

    def _place(
        self,
        name: str,
        adapter: Adapter,
        origin: LoadOrigin,
        started: float,
        *,
        pin: bool = False,
        keep: frozenset[str] = frozenset(),
        demand: bool = False,
    ) -> SlotWrite:
        """With the write lock held: claim a slot, write it, publish the map naming it."""
        deadline = time.monotonic() + self.load_timeout_s
        with self._cond:
            slot, placement, victim = self._claim_slot(name, deadline, keep)
        claimed = time.perf_counter()
        try:
            self._slots.write(slot, adapter)
        except BaseException:
            with self._cond:  # readers waiting for the rewrite go on, to a map without it
                self._rewriting.discard(name)
                self._cond.notify_all()
            raise
        wrote = time.perf_counter()
        with self._cond:
            old = self._snapshot.slot_of.get(name)
            self._publish({**self._snapshot.slot_of, name: slot})
            self._rewriting.discard(name)  # with the publication: waiting readers find it
            self._last_used[name] = next(self._clock)
            if pin:
                self._pinned.add(name)
            result = SlotWrite(slot, placement, victim, origin, wrote - started)
            self._tally.record(result, wrote - claimed, demand=demand)
            drained = old is not None and old != slot and old not in self._leases.busy()
            self._cond.notify_all()
        if drained:
            self._slots.write(old, None)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "adapter %r -> slot %d (%s%s) from %s: %.2f ms in all, wrote %.2f ms (%.3f MB)",
                name,
                slot,
                placement.value,
                f", evicted {victim!r}" if victim else "",
                origin.value,
                1e3 * (wrote - started),
                1e3 * (wrote - claimed),
                adapter_bytes(adapter) / 1e6,
            )
        return result

    def _unload_locked(self, name: str) -> None:
        with self._cond:
            snap = self._snapshot
            if name not in snap.slot_of:
                raise InputError(
                    "adapter name", repr(name), f"a loaded adapter {sorted(snap.slot_of)}"
                )
            slot = snap.slot_of[name]
            self._publish({n: s for n, s in snap.slot_of.items() if n != name})
            self._last_used.pop(name, None)
            self._pinned.discard(name)
            drained = slot not in self._leases.busy()
        if drained:
            self._slots.write(slot, None)

    def _touch(self, names: Sequence[str | None]) -> None:
        """Record use for LRU eviction (under the lock); names used together tie."""
        now = next(self._clock)
        for name in set(names) - {None}:
            if name in self._last_used:
                self._last_used[name] = now

    def _publish(self, slot_of: dict[str, int]) -> None:
        """Under the lock: the next version (same banks, new map)."""
        self._snapshot = BankSnapshot(
            self._snapshot.version + 1, self._banks, MappingProxyType(slot_of)
        )

    def _claim_slot(
        self, name: str, deadline: float, keep: frozenset[str]
    ) -> tuple[int, Placement, str | None]:
        """Under the lock: (slot, placement, evicted name) for `name`'s new weights
        (placement.choose_slot), with the map published without the name (rewritten in
        place) or without the evicted adapter. Waits for leases to drain until `deadline`."""
        while True:
            slot_of, busy = self._snapshot.slot_of, self._leases.busy()
            choice = choose_slot(
                name,
                slot_of,
                busy,
                self.num_slots,
                pinned=self._pinned,
                keep=keep,
                last_used=self._last_used,
            )
            if choice is not None:
                gone = name if choice.placement is Placement.IN_PLACE else choice.evicted
                if gone is not None:  # no new lease can reach the slot being written
                    self._publish({n: s for n, s in slot_of.items() if n != gone})
                if choice.placement is Placement.IN_PLACE:
                    self._rewriting.add(name)
                if choice.evicted is not None:
                    self._last_used.pop(choice.evicted, None)
                return choice.slot, choice.placement, choice.evicted
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise InputError(
                    "adapter slots",
                    f"still leased after {self.load_timeout_s} s (slot -> leases "
                    f"{dict(sorted(busy.items()))})",
                    "a free slot or an unpinned adapter's slot no forward holds; end the "
                    "reading() blocks sooner, raise load_timeout_s or raise num_slots",
                )
            self._cond.wait(
                min(remaining, _EVENT_POLL_S) if self._leases.has_pending else remaining
            )
