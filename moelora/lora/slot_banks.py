"""SlotBanks: the device half of the slot manager. Every MoE layer's LoRABank, allocated once
and written in place one slot at a time; on CUDA through a side stream, so a slot write
(asynchronous copies from pinned host memory) runs beside the forwards on other streams.
Legend: L slots, R max rank, E experts, S = 2 gated / 1 non-gated.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from types import MappingProxyType

import torch

from ..config import ModelConfig
from ..weights import LoRABank
from .adapter import Adapter
from .module_banks import ModuleBanks, ModuleShape


class SlotBanks:
    """banks[layer]: LoRABank w13_a [L, E, S, R, H], ... on `device` in `dtype`; modules:
    the dense Linear modules' banks (module_banks.py), written with the same slot."""

    def __init__(
        self,
        model_config: ModelConfig,
        num_slots: int,
        max_rank: int,
        device: torch.device | str | None,
        dtype: torch.dtype,
        modules: Mapping[str, ModuleShape] | None = None,
    ) -> None:
        self.modules = ModuleBanks(modules or {}, num_slots, max_rank)
        banks = {
            layer: LoRABank.empty(
                model_config.shape, num_slots, max_rank, device=device, dtype=dtype
            )
            for layer in model_config.moe_layers
        }
        for bank in banks.values():  # every slot empty: rank 0, no lanes, no work
            bank.ranks.zero_()
            bank.tile_rank = 0
        self.banks = MappingProxyType(banks)
        self._ranks = [0] * num_slots  # host copy of each slot's real rank (0: empty)
        first = next(iter(banks.values()), None)
        self.device = first.w13_a.device if first is not None else torch.device(device or "cpu")
        self.stream = None
        if self.device.type == "cuda":
            # Writes go to a side stream; the zeros above were queued on the current one.
            torch.cuda.current_stream(self.device).synchronize()
            self.stream = torch.cuda.Stream(device=self.device)

    def release_event(self) -> torch.cuda.Event | None:
        """On CUDA (not while capturing a graph, where a replay, not the capture, reads the
        slots): an event after the work queued so far on the current stream."""
        if self.stream is None or torch.cuda.is_current_stream_capturing():
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def write(self, slot: int, adapter: Adapter | None) -> None:
        """Write `slot` of every layer in place: zeros, then the adapter's factors (rank
        r < R fills [:r]; a layer it lacks stays zero) and the slot's real rank (0 where the
        adapter lacks the layer, or for None). On CUDA on the side stream, synchronized
        before returning, so a map naming the slot can follow the data. Every bank's
        tile_rank becomes the largest rank loaded."""
        self._ranks[slot] = 0 if adapter is None else adapter.rank
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            for layer, bank in self.banks.items():
                for t in (bank.w13_a, bank.w13_b, bank.w2_a, bank.w2_b):
                    t[slot].zero_()
                lora = None if adapter is None else adapter.layers.get(layer)
                bank.ranks[slot] = 0 if lora is None else adapter.rank
                bank.tile_rank = max(self._ranks)
                if lora is not None:
                    r = adapter.rank
                    bank.w13_a[slot, :, :, :r].copy_(lora.w13_a, non_blocking=True)
                    bank.w13_b[slot, :, :, :, :r].copy_(lora.w13_b, non_blocking=True)
                    bank.w2_a[slot, :, :r].copy_(lora.w2_a, non_blocking=True)
                    bank.w2_b[slot, :, :, :r].copy_(lora.w2_b, non_blocking=True)
            self.modules.write(slot, {} if adapter is None else adapter.modules)
        if self.stream is not None:
            self.stream.synchronize()
