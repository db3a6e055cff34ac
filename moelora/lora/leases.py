"""What a forward holds: a BankSnapshot (one published name -> slot map over the banks)
and a lease on the slots that map gives it (SlotLeases, counted per slot).

A lease is taken when a reader gets its map (SlotManager.reading) and released when the
reader is done. On CUDA the reader's kernels may still be queued after it released the
lease, so the release keeps a CUDA event recorded on the reader's stream: the slots stay
busy until that event has completed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..errors import InputError
from ..weights import LoRABank


@dataclass(frozen=True)
class BankSnapshot:
    """One published version: banks[layer] is a LoRABank with w13_a [L, E, S, R, H], ...;
    slot_of maps adapter name -> slot. The banks are the manager's own tensors, the same in
    every version: a slot named by slot_of is only guaranteed unchanged while a lease
    (SlotManager.reading) holds it. slot_of is never changed after publication."""

    version: int
    banks: Mapping[int, LoRABank]
    slot_of: Mapping[str, int]

    def slots(self, names: Sequence[str | None]) -> list[int]:
        """One slot per name (None: base model, -1); InputError for a name not loaded."""
        for name in names:
            if name is not None and name not in self.slot_of:
                raise InputError(
                    "adapter name", repr(name), f"None or a loaded adapter {sorted(self.slot_of)}"
                )
        return [-1 if name is None else self.slot_of[name] for name in names]

    def token_slots(
        self, names: Sequence[str | None], device: torch.device | str | None = None
    ) -> torch.Tensor:
        """token_slots [T] int32 from one adapter name (or None: base model, -1) per token."""
        return torch.tensor(self.slots(names), dtype=torch.int32, device=device)


class SlotLeases:
    """Open leases per slot and the events of released ones. Not locked by itself: the
    SlotManager calls every method under its lock."""

    def __init__(self, num_slots: int) -> None:
        self._count = [0] * num_slots
        # (slots, event) of released leases whose GPU work may still be running.
        self._pending: list[tuple[frozenset[int], torch.cuda.Event]] = []

    def acquire(self, slots: frozenset[int]) -> None:
        for slot in slots:
            self._count[slot] += 1

    def release(self, slots: frozenset[int], event: torch.cuda.Event | None) -> None:
        for slot in slots:
            assert self._count[slot] > 0, f"slot {slot} released more often than leased"
            self._count[slot] -= 1
        if event is not None and slots:
            self._pending.append((slots, event))

    @property
    def has_pending(self) -> bool:
        """Events nobody is notified about: a waiting writer has to poll them."""
        return bool(self._pending)

    def busy(self) -> Counter[int]:
        """slot -> open leases + released leases whose GPU work has not finished; a slot
        absent from the result may be written."""
        self._pending = [(slots, ev) for slots, ev in self._pending if not ev.query()]
        busy = Counter({slot: n for slot, n in enumerate(self._count) if n})
        for slots, _ in self._pending:
            busy.update(slots)
        return busy
