"""LoRA adapters for the expert layers: PEFT loading (`load_adapter`) and device slots
(`SlotManager`)."""

from .adapter import Adapter, LayerLoRA, load_adapter
from .fused import ORIENTATIONS
from .slots import BankSnapshot, SlotManager

__all__ = ["ORIENTATIONS", "Adapter", "BankSnapshot", "LayerLoRA", "SlotManager", "load_adapter"]
