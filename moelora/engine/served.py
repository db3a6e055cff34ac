"""What the engine asks of the model it serves: a typed Protocol, so that the engine depends
on the facts it reads and never on the transformers integration that provides them
(moelora.hf.MoELoRAModel implements it; tests may pass a stand-in)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from ..lora.module_banks import ModuleBanks
from ..lora.registry import AdapterHold, Version


class ServedModel(Protocol):
    """A transformers causal LM whose MoE layers and LoRA modules read the call context
    (moelora.lora.rows), with its adapter registry."""

    model: nn.Module  # the transformers model (its forward, config, caches)
    device: torch.device
    enforce_eager: bool | None  # None: CUDA graphs on a GPU; True: never
    layers: dict[int, nn.Module]  # MoE layer index -> the MoELoRALayer serving its experts

    @property
    def module_banks(self) -> ModuleBanks:
        """The served Linear modules' and routers' LoRA banks (path -> a, bt)."""

    @property
    def num_slots(self) -> int:
        """Adapters the device's slots hold at once."""

    @property
    def lora_modules(self) -> frozenset[str]:
        """The served Linear modules some loaded adapter has factors on."""

    @property
    def pinned_keys(self) -> frozenset[str]:
        """The version keys of the pinned adapters (their slots are never free)."""

    def version(self, name: str | None) -> Version | None:
        """The current version of an adapter name (None: base model, or not loaded)."""

    def hold(self, names: Sequence[str | None]) -> list[AdapterHold]:
        """The current versions of `names` held at once (InputError for one not loaded)."""
