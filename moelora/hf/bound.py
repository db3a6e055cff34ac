"""What attach() changed in a transformers model, kept by the handle so that detach() can give
the model back as it was: the experts modules bound, the Llama 4 blocks swapped, the experts
implementation set before, the Linear modules' LoRA hooks, the FP8 Linears' forwards."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from . import experts
from .fp8_linears import FP8Linears
from .module_lora import ModuleHooks


@dataclass(frozen=True)
class Bound:
    """What attach changed in the model, for detach(): the experts modules bound, the Llama 4
    blocks swapped, the experts implementation set before, the Linear modules' hooks, the
    FP8 Linears moelora's kernel computes."""

    modules: list[nn.Module]
    swapped: list[tuple[nn.Module, str, nn.Module]]
    previous: str | None
    hooks: ModuleHooks | None
    fp8_linears: FP8Linears | None = None

    def undo(self, model: nn.Module) -> Bound:
        """Give `model` back as it was before attach; returns what is left bound (nothing)."""
        if self.hooks is not None:
            self.hooks.remove()
        if self.fp8_linears is not None:
            self.fp8_linears.remove()
        for module in self.modules:
            experts.unbind(module)
        for parent, attr, original in self.swapped:
            setattr(parent, attr, original)
        if not self.swapped and self.previous not in (None, experts.NAME):
            model.set_experts_implementation(self.previous)
        return Bound([], [], self.previous, None)
