"""SlotManager: L adapter slots per MoE layer, loaded, replaced, unloaded, pinned and evicted.

Every MoE layer's bank is allocated once and written in place, one slot at a time. Forwards
read through a lease (`reading()`): the name -> slot map of one published version plus a
count on each slot it names, and a writer never writes a slot that is in the current map
or leased. A load therefore writes a free slot (or evicts an unleased LRU adapter first),
synchronizes, and only then publishes the map that names it: no forward sees a
half-written slot, and a forward keeps the adapters it started with until it releases the
lease. Legend: L slots, R max rank, E experts, S = 2 gated / 1 non-gated.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import MappingProxyType

import torch

from ..config import ModelConfig
from ..errors import AdapterError, ConfigError, InputError
from ..weights import LoRABank
from .adapter import Adapter, load_adapter
from .leases import BankSnapshot, SlotLeases

# A writer waiting for a slot is woken when a lease is released, but nothing wakes it when
# a released lease's CUDA event completes, so it polls. 5 ms (chosen, not measured): at most
# that much added to a load, which copies megabytes per layer anyway, without spinning.
_EVENT_POLL_S = 0.005


class SlotManager:
    """Owns the LoRA slot banks of every MoE layer of one model.

    load_timeout_s: how long a load waits for a slot no forward holds before raising.
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
    ) -> None:
        if num_slots < 1:
            raise ConfigError("max_loras", num_slots, "a positive integer")
        if max_rank < 1:
            raise ConfigError("max_lora_rank", max_rank, "a positive integer")
        if not load_timeout_s >= 0:
            raise ConfigError("load_timeout_s", load_timeout_s, "seconds >= 0")
        self.model_config, self.num_slots, self.max_rank = model_config, num_slots, max_rank
        self.load_timeout_s = load_timeout_s
        self._cond = threading.Condition()  # map, leases, LRU clock, pins
        self._write_lock = threading.Lock()  # one writer at a time; readers never take it
        self._clock = itertools.count()
        self._last_used: dict[str, int] = {}
        self._pinned: set[str] = set()
        self._leases = SlotLeases(num_slots)
        banks = {
            layer: LoRABank.empty(
                model_config.shape, num_slots, max_rank, device=device, dtype=dtype
            )
            for layer in model_config.moe_layers
        }
        self._banks = MappingProxyType(banks)
        first = next(iter(banks.values()), None)
        self._device = first.w13_a.device if first is not None else torch.device("cpu")
        self._stream = None
        if self._device.type == "cuda":
            # Writes go to a side stream; the zeros above were queued on the current one.
            torch.cuda.current_stream(self._device).synchronize()
            self._stream = torch.cuda.Stream(device=self._device)
        self._snapshot = BankSnapshot(0, self._banks, MappingProxyType({}))

    # ---- reading (any thread) ---------------------------------------------------------------

    @contextmanager
    def reading(
        self, names: Sequence[str | None], device: torch.device | str | None = None
    ) -> Iterator[tuple[BankSnapshot, torch.Tensor]]:
        """Lease the slots of `names` (None: base model) for a forward; yields (snapshot,
        token_slots [T] int32). Until the block exits (on CUDA: until the work queued on the
        current stream by then has run) no load, replace or unload writes those slots."""
        with self._cond:
            snap = self._snapshot
            slots = snap.slots(names)
            held = frozenset(s for s in slots if s >= 0)
            self._leases.acquire(held)
            self._touch(names)
        try:
            yield snap, torch.tensor(slots, dtype=torch.int32, device=device)
        finally:
            event = None
            # Not while capturing a CUDA graph: a replay, not the capture, reads the slots.
            if self._stream is not None and held and not torch.cuda.is_current_stream_capturing():
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self._device))
            with self._cond:
                self._leases.release(held, event)
                self._cond.notify_all()

    def snapshot(self) -> BankSnapshot:
        """The current version; reading one attribute is atomic, so no lock is needed."""
        return self._snapshot

    def token_slots(
        self, names: Sequence[str | None], device: torch.device | str | None = None
    ) -> tuple[BankSnapshot, torch.Tensor]:
        """(snapshot, token_slots [T] int32) consistent with each other; marks names used.
        Takes no lease: safe only while no load, replace or unload runs concurrently (a load
        may rewrite a slot this map names). Concurrent serving uses reading()."""
        with self._cond:
            snap = self._snapshot
            self._touch(names)
        return snap, snap.token_slots(names, device)

    @property
    def loaded(self) -> dict[str, int]:
        return dict(self._snapshot.slot_of)

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
    ) -> int:
        """Load an adapter into a slot no forward holds; returns its slot.

        Takes a free slot, else evicts the least recently used unpinned adapter whose slot
        is not leased; waits up to load_timeout_s for one. A name already loaded is replaced:
        the new weights go to such a slot, then the name moves there. Every check runs
        before any slot is touched: a failed load leaves every slot and the map as they were.
        """
        if not isinstance(adapter, Adapter):
            adapter = load_adapter(
                adapter,
                self.model_config,
                self.max_rank,
                name=name,
                fused_orientation=fused_orientation,
                serves_non_expert=serves_non_expert,
            )
        name = name or adapter.name
        self._check_fits(adapter)
        with self._write_lock:
            deadline = time.monotonic() + self.load_timeout_s
            with self._cond:
                old = self._snapshot.slot_of.get(name)
                if must_exist and old is None:  # the write lock keeps unload out until we end
                    raise InputError(
                        "adapter name", repr(name), f"a loaded adapter {sorted(self.loaded)}"
                    )
                slot = self._claim_slot(name, deadline)
            self._write(slot, adapter)
            with self._cond:
                self._publish({**self._snapshot.slot_of, name: slot})
                self._last_used[name] = next(self._clock)
                if pin:
                    self._pinned.add(name)
                drained = old is not None and old != slot and old not in self._leases.busy()
            if drained:
                self._write(old, None)
        return slot

    def replace(self, name: str, adapter: Adapter | str | Path) -> int:
        """Swap the adapter behind a loaded name: the new weights go to another slot (free,
        or an unleased LRU adapter's), then the name moves there. Forwards holding the old
        slot keep it until they end; it is then free. With no such slot, the name's own slot
        is rewritten once unleased (the name unmapped meanwhile). Returns the new slot."""
        return self.load(adapter, name=name, must_exist=True)

    def unload(self, name: str) -> None:
        """Free the adapter's slot: zeroed now if no forward holds it, else left as it is
        (named by no map) until the load that reuses it overwrites it in full."""
        with self._write_lock:
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
                self._write(slot, None)

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

    # ---- internals ----------------------------------------------------------------------------

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

    def _claim_slot(self, name: str, deadline: float) -> int:
        """Under the lock: a slot in no map and no lease; evicting (and publishing the map
        without) the LRU unpinned adapter other than `name` when none is free. Waits for
        leases to drain until `deadline`."""
        while True:
            slot_of, busy = self._snapshot.slot_of, self._leases.busy()
            mapped = set(slot_of.values())
            free = [s for s in range(self.num_slots) if s not in mapped and s not in busy]
            if free:
                return free[0]
            candidates = [n for n in slot_of if n != name and n not in self._pinned]
            own = slot_of.get(name)  # replace: the name's current slot
            if not candidates and len(mapped) == self.num_slots and own is None:
                raise ConfigError(  # no lease ending would help
                    "max_loras",
                    self.num_slots,
                    "a free slot or an unpinned adapter to evict",
                    "unpin or unload an adapter, or raise max_loras",
                )
            evictable = [n for n in candidates if slot_of[n] not in busy]
            if evictable:
                victim = min(evictable, key=lambda n: self._last_used.get(n, -1))
                self._publish({n: s for n, s in slot_of.items() if n != victim})
                self._last_used.pop(victim, None)
                return slot_of[victim]
            if own is not None and own not in busy:
                # Last resort (e.g. one slot): rewrite the replaced adapter's own slot. The name
                # is unmapped while it is written, so no new lease can reach a half-written slot.
                self._publish({n: s for n, s in slot_of.items() if n != name})
                return own
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise InputError(
                    "adapter slots",
                    f"still leased after {self.load_timeout_s} s (slot -> leases "
                    f"{dict(sorted(busy.items()))})",
                    "a free slot or an unpinned adapter's slot no forward holds; end the "
                    "reading() blocks sooner, raise load_timeout_s or raise max_loras",
                )
            self._cond.wait(
                min(remaining, _EVENT_POLL_S) if self._leases.has_pending else remaining
            )

    def _write(self, slot: int, adapter: Adapter | None) -> None:
        """Write `slot` of every layer in place: zeros, then the adapter's factors (rank
        r < R fills [:r]; a layer it lacks stays zero). On CUDA on the side stream, which is
        synchronized before returning, so the map that names the slot comes after the data."""
        with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
            for layer, bank in self._banks.items():
                for t in (bank.w13_a, bank.w13_b, bank.w2_a, bank.w2_b):
                    t[slot].zero_()
                lora = None if adapter is None else adapter.layers.get(layer)
                if lora is not None:
                    r = adapter.rank
                    bank.w13_a[slot, :, :, :r].copy_(lora.w13_a)
                    bank.w13_b[slot, :, :, :, :r].copy_(lora.w13_b)
                    bank.w2_a[slot, :, :r].copy_(lora.w2_a)
                    bank.w2_b[slot, :, :, :r].copy_(lora.w2_b)
        if self._stream is not None:
            self._stream.synchronize()

    def _check_fits(self, adapter: Adapter) -> None:
        s, a = self.model_config.shape, adapter.shape
        dims = ("num_experts", "hidden_size", "intermediate_size")
        if any(getattr(s, d) != getattr(a, d) for d in dims) or (
            s.activation.width_factor != a.activation.width_factor
        ):
            raise AdapterError(
                adapter.path,
                "<model>",
                f"an adapter loaded for {a}",
                f"one for {s}",
                "load the adapter with this manager's model config",
            )
        if adapter.rank > self.max_rank:
            raise AdapterError(
                adapter.path,
                "<rank>",
                f"rank {adapter.rank}",
                f"at most R = {self.max_rank}",
                "raise max_lora_rank",
            )
        extra = set(adapter.layers) - set(self.model_config.moe_layers)
        if extra:
            raise AdapterError(
                adapter.path,
                "<layers>",
                f"layers {sorted(extra)}",
                f"MoE layers {list(self.model_config.moe_layers)}",
            )
