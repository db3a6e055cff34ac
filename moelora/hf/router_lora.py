"""Router (gate) LoRA served per token: the router's logits get the LoRA delta of each
token's slot before the router's own softmax / top-k.

Transformers' MoE routers are modules with a weight [E, H] that compute their logits with
one F.linear inside their forward and return what follows (scores, top-k ids), so a hook
on the output cannot add a delta to the logits. The router's forward runs instead under a
torch function mode that adds dense_lora_delta to the result of that F.linear (PEFT's
ParamWrapper merges the same delta into the weight: x (W + B A)^T = x W^T + (x A^T) B^T).
The mode is pushed on the calling thread only, and only in a handle call with router LoRA.
Legend: T tokens, H hidden, E experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..config import ModelConfig
from ..errors import ConfigError
from ..lora.module_banks import dense_lora_delta
from ..lora.rows import RowAdapters, current

_NAMES = ("gate", "router")


def find_routers(model: nn.Module, model_config: ModelConfig) -> dict[str, nn.Module]:
    """path -> router module: named gate / router, not a plain nn.Linear, with a weight
    [E, H] of the config's expert count and hidden size."""
    want = (model_config.shape.num_experts, model_config.shape.hidden_size)
    found = {}
    for path, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (
            path.rsplit(".", 1)[-1] in _NAMES
            and type(module) is not nn.Linear
            and isinstance(weight, torch.Tensor)
            and tuple(weight.shape) == want
        ):
            found[path] = module
    return found


def serve_router(
    module: nn.Module, path: str, a: torch.Tensor, bt: torch.Tensor
) -> Callable[[], None]:
    """Run `module`'s forward with its logits' per-token delta (bank a [L, R, H],
    bt [L, R, E]) in handle calls where a row has LoRA on `path`; returns the undo."""
    original = module.forward

    def forward(*args, **kwargs):
        rows = current()
        if rows is None or path not in rows.lora_modules:
            return original(*args, **kwargs)
        mode = _AddDelta(rows, a, bt)
        with mode:
            out = original(*args, **kwargs)
        if mode.applied != 1:
            raise ConfigError(
                type(module).__name__,
                f"{mode.applied} F.linear calls in its forward",
                "a router computing its logits with one F.linear (transformers' routers)",
                "load adapters without LoRA on this router",
            )
        return out

    module.forward = forward
    return lambda: delattr(module, "forward")


class _AddDelta(TorchFunctionMode):
    """Adds the per-token delta to the result of each F.linear run under it (the router's
    one logits Linear); counts them."""

    def __init__(self, rows: RowAdapters, a: torch.Tensor, bt: torch.Tensor) -> None:
        super().__init__()
        self.rows, self.a, self.bt, self.applied = rows, a, bt, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is F.linear:
            x = args[0].reshape(-1, args[0].shape[-1])
            slots = self.rows.slots_for(x.shape[0], "router input")
            delta = dense_lora_delta(x.to(self.a.dtype), slots, self.a, self.bt)
            out = out + delta.view(out.shape).to(out.dtype)
            self.applied += 1
        return out
