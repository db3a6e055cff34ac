"""SlotManager: L adapter slots per MoE layer, loaded, replaced, unloaded, pinned and evicted.

Forwards read a BankSnapshot: the banks and name -> slot map of one version, never
written again. A load or unload builds the next version by copy-on-write (clone the
banks, write the slot, publish the new snapshot under the lock), so a forward that took
an older snapshot keeps computing with exactly the adapters it saw, and no forward ever
sees a half-written slot. The price is one bank clone per load; loads are rare next to
forwards. Legend: L slots, R max rank, E experts, S = 2 gated / 1 non-gated.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from ..config import ModelConfig
from ..errors import AdapterError, ConfigError, InputError
from ..weights import LoRABank
from .adapter import Adapter, load_adapter


@dataclass(frozen=True)
class BankSnapshot:
    """One published version: banks[layer] is a LoRABank with w13_a [L, E, S, R, H], ...;
    slot_of maps adapter name -> slot. Nothing in a snapshot is written after publication."""

    version: int
    banks: Mapping[int, LoRABank]
    slot_of: Mapping[str, int]

    def token_slots(
        self, names: Sequence[str | None], device: torch.device | str | None = None
    ) -> torch.Tensor:
        """token_slots [T] int32 from one adapter name (or None: base model, -1) per token."""
        out = []
        for name in names:
            if name is not None and name not in self.slot_of:
                raise InputError(
                    "adapter name", repr(name), f"None or a loaded adapter {sorted(self.slot_of)}"
                )
            out.append(-1 if name is None else self.slot_of[name])
        return torch.tensor(out, dtype=torch.int32, device=device)


class SlotManager:
    """Owns the LoRA slot banks of every MoE layer of one model."""

    def __init__(
        self,
        model_config: ModelConfig,
        num_slots: int,
        max_rank: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if num_slots < 1:
            raise ConfigError("max_loras", num_slots, "a positive integer")
        if max_rank < 1:
            raise ConfigError("max_lora_rank", max_rank, "a positive integer")
        self.model_config, self.num_slots, self.max_rank = model_config, num_slots, max_rank
        self._lock = threading.Lock()
        self._clock = itertools.count()
        self._last_used: dict[str, int] = {}
        self._pinned: set[str] = set()
        banks = {
            layer: LoRABank.empty(
                model_config.shape, num_slots, max_rank, device=device, dtype=dtype
            )
            for layer in model_config.moe_layers
        }
        self._snapshot = BankSnapshot(0, MappingProxyType(banks), MappingProxyType({}))

    # ---- reading (any thread) ---------------------------------------------------------------

    def snapshot(self) -> BankSnapshot:
        """The current version; reading one attribute is atomic, so no lock is needed."""
        return self._snapshot

    def token_slots(
        self, names: Sequence[str | None], device: torch.device | str | None = None
    ) -> tuple[BankSnapshot, torch.Tensor]:
        """(snapshot, token_slots [T] int32) consistent with each other; marks names used."""
        snap = self._snapshot
        slots = snap.token_slots(names, device)
        with self._lock:
            for name in set(names) - {None}:
                if name in self._last_used:
                    self._last_used[name] = next(self._clock)
        return snap, slots

    @property
    def loaded(self) -> dict[str, int]:
        return dict(self._snapshot.slot_of)

    # ---- writing (serialized by the lock) -----------------------------------------------------

    def load(
        self,
        adapter: Adapter | str | Path,
        *,
        name: str | None = None,
        pin: bool = False,
        fused_orientation: str | None = None,
        must_exist: bool = False,
    ) -> int:
        """Load (or replace, keeping its slot) an adapter; returns its slot.

        Takes a free slot, else evicts the least recently used unpinned adapter. Every check
        runs before any slot is touched: a failed load leaves every slot as it was.
        """
        if not isinstance(adapter, Adapter):
            adapter = load_adapter(
                adapter,
                self.model_config,
                self.max_rank,
                name=name,
                fused_orientation=fused_orientation,
            )
        name = name or adapter.name
        self._check_fits(adapter)
        with self._lock:
            snap = self._snapshot
            slot = snap.slot_of.get(name)
            if must_exist and slot is None:  # checked under the lock: no race with unload
                raise InputError(
                    "adapter name", repr(name), f"a loaded adapter {sorted(snap.slot_of)}"
                )
            slot_of = dict(snap.slot_of)
            if slot is None:
                slot = self._free_slot(snap)
                slot_of = {n: s for n, s in slot_of.items() if s != slot}
                for evicted in set(snap.slot_of) - set(slot_of):
                    self._last_used.pop(evicted, None)
                slot_of[name] = slot
            self._publish(snap, slot, adapter, slot_of)
            self._last_used[name] = next(self._clock)
            if pin:
                self._pinned.add(name)
        return slot

    def replace(self, name: str, adapter: Adapter | str | Path) -> int:
        """Swap the adapter behind a loaded name in place (same slot)."""
        return self.load(adapter, name=name, must_exist=True)

    def unload(self, name: str) -> None:
        """Free the adapter's slot (zeroed in the next version)."""
        with self._lock:
            snap = self._snapshot
            if name not in snap.slot_of:
                raise InputError(
                    "adapter name", repr(name), f"a loaded adapter {sorted(snap.slot_of)}"
                )
            slot_of = {n: s for n, s in snap.slot_of.items() if n != name}
            self._publish(snap, snap.slot_of[name], None, slot_of)
            self._last_used.pop(name, None)
            self._pinned.discard(name)

    def pin(self, name: str) -> None:
        """Never evict this adapter (it can still be unloaded or replaced explicitly)."""
        with self._lock:
            if name not in self._snapshot.slot_of:
                raise InputError(
                    "adapter name", repr(name), f"a loaded adapter {sorted(self.loaded)}"
                )
            self._pinned.add(name)

    def unpin(self, name: str) -> None:
        with self._lock:
            self._pinned.discard(name)

    # ---- internals ----------------------------------------------------------------------------

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

    def _free_slot(self, snap: BankSnapshot) -> int:
        used = set(snap.slot_of.values())
        free = [s for s in range(self.num_slots) if s not in used]
        if free:
            return free[0]
        candidates = [n for n in snap.slot_of if n not in self._pinned]
        if not candidates:
            raise ConfigError(
                "max_loras",
                self.num_slots,
                "a free or unpinned slot (all are pinned)",
                "unpin or unload an adapter, or raise max_loras",
            )
        victim = min(candidates, key=lambda n: self._last_used.get(n, -1))
        return snap.slot_of[victim]

    def _publish(
        self, snap: BankSnapshot, slot: int, adapter: Adapter | None, slot_of: dict[str, int]
    ) -> None:
        """Copy-on-write: clone every bank, write `slot` (zeros if adapter is None), publish."""
        banks = {}
        for layer, bank in snap.banks.items():
            new = LoRABank(*(t.clone() for t in (bank.w13_a, bank.w13_b, bank.w2_a, bank.w2_b)))
            for t in (new.w13_a, new.w13_b, new.w2_a, new.w2_b):
                t[slot].zero_()
            lora = None if adapter is None else adapter.layers.get(layer)
            if lora is not None:
                r = adapter.rank  # rank below R: the rest of the slot stays zero
                new.w13_a[slot, :, :, :r].copy_(lora.w13_a)
                new.w13_b[slot, :, :, :, :r].copy_(lora.w13_b)
                new.w2_a[slot, :, :r].copy_(lora.w2_a)
                new.w2_b[slot, :, :, :r].copy_(lora.w2_b)
            banks[layer] = new
        first = next(iter(banks.values()), None)
        if first is not None and first.w13_a.is_cuda:
            # Forwards on other streams must not read the new banks before the copies land.
            torch.cuda.current_stream(first.w13_a.device).synchronize()
        self._snapshot = BankSnapshot(
            snap.version + 1, MappingProxyType(banks), MappingProxyType(slot_of)
        )
