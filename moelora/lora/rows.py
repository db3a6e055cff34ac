"""The call context: what one forward tells the layers of the model, the adapter of every
row (`RowAdapters`), current for the calling thread for the forward (`using`, `current`).

The caller (the transformers handle for a generate / forward call, the decode engine for a
step) builds a `RowAdapters` with the per-row slots in a buffer it keeps on the device (one
host-to-device copy) and makes it current; the first MoE layer of each forward expands the
rows to one slot per token into a second kept buffer on the device (no host sync), every MoE
layer reads it, and the served Linear modules and routers (hf/module_lora.py) expand the
same row slots over their own input's tokens. Both buffers stay the same tensors across
calls, so a CUDA graph captured over a forward reads the slots of the call it is replayed
in. Legend: B rows, S tokens per row, T = B * S.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor

from ..errors import InputError
from .leases import BankSnapshot

BASE = "__base__"  # PEFT's name for a row without adapter

_current = threading.local()


@dataclass
class RowAdapters:
    """row_slots [B] int32 on the model's device (-1 = no adapter); snapshot: the slot banks
    those slots index, expert and module banks alike (held by a lease for the whole call)."""

    row_slots: Tensor
    snapshot: BankSnapshot
    # Python branches, fixed in a captured CUDA graph: a graph meant to serve any adapter
    # mix is captured with both True (rows of slot -1 or without the module add exactly 0).
    expert_lora: bool  # some row's adapter has expert factors
    # paths of the served Linear modules / routers some row's adapter has factors on (the
    # others skip their delta); a graph for any mix is captured with every served path
    lora_modules: frozenset[str]
    token_buffer: Tensor  # [capacity >= T] int32, kept by the thread across calls

    @property
    def rows(self) -> int:
        return self.row_slots.shape[0]

    def token_slots(self, tokens: int, refresh: bool) -> Tensor:
        """token_slots [T] int32: each row's slot repeated for its S = T / B tokens, in the
        kept token buffer. refresh: write it (the first MoE layer of a forward does);
        the other layers read what it wrote."""
        per_row = self._per_row(tokens, "hidden_states")
        if tokens > self.token_buffer.shape[0]:
            raise InputError(
                "hidden_states",
                f"{tokens} tokens",
                f"at most the {self.token_buffer.shape[0]} tokens the handle sized for this call",
            )
        slots = self.token_buffer[:tokens]
        if refresh:
            slots.copy_(self.row_slots.repeat_interleave(per_row, output_size=tokens))
        return slots

    def slots_for(self, tokens: int, what: str) -> Tensor:
        """slots [T] int32 for a module input of T = B * S' tokens in row-major order (S' its
        own tokens per row: the LM head may see only the last one): each row's slot repeated
        S' times, computed on the device (no host sync)."""
        per_row = self._per_row(tokens, what)
        if per_row == 1:
            return self.row_slots
        return self.row_slots.repeat_interleave(per_row, output_size=tokens)

    def _per_row(self, leading: int, what: str) -> int:
        if leading % self.rows:
            raise InputError(
                what,
                f"{leading} rows",
                f"a multiple of the call's {self.rows} rows: pass one adapter name per row of "
                "input_ids (the handle expands them for num_beams / num_return_sequences)",
            )
        return leading // self.rows


def current() -> RowAdapters | None:
    """The calling thread's current call, or None (outside the handle: the base model)."""
    return getattr(_current, "rows", None)


@contextmanager
def using(rows: RowAdapters) -> Iterator[RowAdapters]:
    """Make `rows` current for this thread for the duration of the block."""
    previous = current()
    if previous is not None:
        raise InputError(
            "adapter_names",
            "a nested call",
            "one handle call at a time per thread (do not call the handle from inside its "
            "own forward)",
        )
    _current.rows = rows
    try:
        yield rows
    finally:
        _current.rows = None
