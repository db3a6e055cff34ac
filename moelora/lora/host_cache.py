"""HostCache: parsed adapters kept in host memory, at most `capacity` of them (vLLM's
--max-cpu-loras), the least recently used dropped first.

On CUDA each entry is a copy in the bank dtype in pinned (page-locked) memory, so the write
into a slot is one asynchronous host-to-device copy per factor, on the slot manager's side
stream. On CPU an entry in the bank dtype is the adapter itself (no copy).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from .adapter import Adapter, LayerLoRA

FACTORS = ("w13_a", "w13_b", "w2_a", "w2_b")
ALIGN_BYTES = 256  # each factor of a pinned host copy starts on this boundary


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
        """The adapter in the bank dtype, pinned when `pin` (one copy, straight into one
        pinned buffer for the whole adapter: one page-locked allocation, not one per factor;
        torch's pinned allocator rounds it up to a power of two); the adapter itself when it
        is in that form already (a registered adapter held in memory is kept in it: its host
        copy is then that same memory)."""
        factors = [(layer, f, getattr(lora, f)) for layer, lora in adapter.layers.items()
                   for f in FACTORS]  # fmt: skip
        convert = [t.dtype != self.dtype or (self.pin and not t.is_pinned()) for *_, t in factors]
        if not any(convert):
            return adapter
        views = iter(self.allocate([t.shape for (*_, t), c in zip(factors, convert) if c]))
        out: dict = {}
        for (layer, f, t), c in zip(factors, convert):
            out.setdefault(layer, {})[f] = next(views).copy_(t) if c else t
        layers = {layer: LayerLoRA(*(out[layer][f] for f in FACTORS)) for layer in out}
        return dataclasses.replace(adapter, layers=layers)

    def allocate(self, sizes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Empty tensors of these sizes in the bank dtype: views of one pinned buffer (each
        starting on a 256-byte boundary) when `pin`, else separate tensors. An adapter parsed
        straight into them is already in its host form (load_adapter's `allocate`)."""
        if not self.pin:
            return [torch.empty(size, dtype=self.dtype) for size in sizes]
        align = max(1, ALIGN_BYTES // torch.empty((), dtype=self.dtype).element_size())
        starts, end = [], 0
        for size in sizes:
            starts.append(end)
            end += -(-math.prod(size) // align) * align
        flat = torch.empty(end, dtype=self.dtype, pin_memory=True)
        return [flat[a : a + math.prod(size)].view(size) for a, size in zip(starts, sizes)]

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
