"""LoRA adapters for the expert layers: PEFT loading (`load_adapter`), device slots
(`SlotManager`), filled on demand from registered adapters through a host cache."""

from .adapter import Adapter, LayerLoRA, load_adapter
from .fused import ORIENTATIONS
from .reports import LoadOrigin, Placement, ServingStats, SlotWrite
from .slots import BankSnapshot, SlotManager

__all__ = [
    "ORIENTATIONS",
    "Adapter",
    "BankSnapshot",
    "LayerLoRA",
    "LoadOrigin",
    "Placement",
    "ServingStats",
    "SlotManager",
    "SlotWrite",
    "load_adapter",
]
