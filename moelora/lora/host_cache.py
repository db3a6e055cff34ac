"""HostCache: parsed adapters kept in host memory, at most `capacity` of them (vLLM's
--max-cpu-loras), the least recently used dropped first.

On CUDA each entry is a copy in the bank dtype in pinned (page-locked) memory, so the write
into a slot is one asynchronous host-to-device copy per factor, on the slot manager's side
stream. On CPU an entry in the bank dtype is the adapter itself (no copy).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict

import torch

from .adapter import Adapter, LayerLoRA

FACTORS = ("w13_a", "w13_b", "w2_a", "w2_b")


def adapter_bytes(adapter: Adapter) -> int:
    """Bytes of the adapter's factors (what a slot write copies)."""
    return sum(getattr(lora, f).nbytes for lora in adapter.layers.values() for f in FACTORS)


class HostCache:
    """name -> host copy of an Adapter. Thread-safe; `convert` runs outside the lock."""

    def __init__(self, capacity: int, dtype: torch.dtype, pin: bool) -> None:
        self.capacity, self.dtype, self.pin = capacity, dtype, pin
        self._entries: OrderedDict[str, Adapter] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    def convert(self, adapter: Adapter) -> Adapter:
        """The adapter in the bank dtype, pinned when `pin` (one copy, straight into the
        pinned buffer); the adapter itself when it is in that form already (a registered
        adapter held in memory is kept in it: its host copy is then that same memory)."""

        def host(t: torch.Tensor) -> torch.Tensor:
            if t.dtype == self.dtype and (not self.pin or t.is_pinned()):
                return t
            if not self.pin:
                return t.to(self.dtype)
            return torch.empty(t.shape, dtype=self.dtype, pin_memory=True).copy_(t)

        layers = {
            layer: LayerLoRA(*(host(getattr(lora, f)) for f in FACTORS))
            for layer, lora in adapter.layers.items()
        }
        same = all(
            getattr(layers[k], f) is getattr(v, f)
            for k, v in adapter.layers.items()
            for f in FACTORS
        )
        return adapter if same else dataclasses.replace(adapter, layers=layers)

    def get(self, name: str) -> Adapter | None:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(name)
            self.hits += 1
            return entry

    def store(self, name: str, adapter: Adapter) -> None:
        """Keep `adapter` (already converted), dropping the least recently used beyond
        capacity; capacity 0 keeps nothing."""
        if self.capacity == 0:
            return
        with self._lock:
            self._entries[name] = adapter
            self._entries.move_to_end(name)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
                self.evictions += 1

    def drop(self, name: str) -> None:
        with self._lock:
            self._entries.pop(name, None)

    def counts(self) -> dict[str, int]:
        """What ServingStats reports about the cache."""
        with self._lock:
            return {
                "host_hits": self.hits,
                "host_misses": self.misses,
                "host_evictions": self.evictions,
                "host_adapters": len(self._entries),
                "host_bytes": sum(adapter_bytes(a) for a in self._entries.values()),
                "host_capacity": self.capacity,
            }
