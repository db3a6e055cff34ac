"""The "moelora" experts implementation for transformers, as one torch custom op.

transformers 5 dispatches each MoE experts module's forward through its ExpertsInterface:
fn(self, hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]. The
function registered here finds the module's binding (its MoELoRALayer and layer index, set
by `attach`) and calls `torch.ops.moelora.experts`, a custom op with a fake implementation,
so `torch.compile(model)` keeps the whole expert layer as one node. The op reads the
calling thread's RowAdapters (moelora/lora/rows.py) for the per-token slots and the slot banks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import ConfigError
from ..layer import MoELoRALayer
from ..lora.rows import current
from .graphs import LayerGraphs

NAME = "moelora"

_bindings: dict[int, ExpertsBinding] = {}
_keys = itertools.count(1)


@dataclass(frozen=True)
class ExpertsBinding:
    """One HF experts module served by moelora: its layer (weights as views of the module's
    own tensors) and its MoE layer index (the slot banks are per layer)."""

    layer: MoELoRALayer
    layer_index: int
    first: bool  # the model's first MoE layer: expands the call's row slots per forward
    graphs: LayerGraphs | None = field(default=None, compare=False)  # small-T CUDA graphs

    def forward(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        ids, weights = topk_ids.to(torch.int32), topk_weights.float()
        rows = current()
        graphed = self.graphs is not None and self.graphs.usable(x)
        if rows is None or not rows.expert_lora:
            if graphed:
                return self.graphs.run(self.layer, x, ids, weights, bank_key=0)
            return self.layer(x, ids, weights)
        slots = rows.token_slots(x.shape[0], refresh=self.first)
        bank = rows.snapshot.banks[self.layer_index]
        if graphed:

            def forward(x, ids, weights, slots):
                return self.layer(x, ids, weights, slots, bank)

            return self.graphs.run(forward, x, ids, weights, slots, bank_key=id(bank.w13_a))
        return self.layer(x, ids, weights, slots, bank)


def bind(module: torch.nn.Module, binding: ExpertsBinding) -> int:
    """Attach a binding to an experts module; returns its key."""
    key = next(_keys)
    _bindings[key] = binding
    module._moelora_key = key
    return key


def key_of(module: torch.nn.Module) -> int | None:
    """The key an experts module is bound under (None: not bound by moelora)."""
    return getattr(module, "_moelora_key", None)


def binding_of(module: torch.nn.Module) -> ExpertsBinding:
    """The binding of an experts module attach() bound."""
    return _bindings[key_of(module)]


def unbind(module: torch.nn.Module) -> None:
    key = getattr(module, "_moelora_key", None)
    _bindings.pop(key, None)
    if key is not None:
        del module._moelora_key


@torch.library.custom_op("moelora::experts", mutates_args=())
def experts_op(
    hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, key: int
) -> Tensor:
    """y [T, H] of the experts bound under `key`, with the current call's adapters."""
    return _bindings[key].forward(hidden_states, top_k_index, top_k_weights)


@experts_op.register_fake
def _experts_fake(hidden_states, top_k_index, top_k_weights, key):
    return torch.empty_like(hidden_states)


def experts_forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor):
    """The function registered in transformers' ExpertsInterface under NAME."""
    key = getattr(self, "_moelora_key", None)
    if key is None or key not in _bindings:
        raise ConfigError(
            "experts_implementation",
            NAME,
            f"an experts module bound by moelora.hf.attach ({type(self).__name__} is not)",
            "call moelora.hf.attach(model, num_slots=..., max_rank=...) before running it",
        )
    return experts_op(hidden_states, top_k_index, top_k_weights, key)


def register() -> None:
    """Register NAME in transformers' ExpertsInterface (idempotent), and in its FP8 experts'
    own interface where it has one: an FP8Experts module (an FP8 checkpoint on a GPU >= sm89)
    dispatches through FP8ExpertsInterface, whose mapping is its own dict."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, experts_forward)
    for interface in fp8_experts_interfaces():
        interface.register(NAME, experts_forward)


def fp8_experts_interfaces() -> list[type]:
    """transformers' FP8 experts interface class, where this version has one (5.24:
    integrations.finegrained_fp8.FP8ExpertsInterface); else none."""
    try:
        from transformers.integrations import finegrained_fp8
    except ImportError:  # a transformers without FP8 experts: they load dequantized
        return []
    found = getattr(finegrained_fp8, "FP8ExpertsInterface", None)
    return [] if found is None else [found]
