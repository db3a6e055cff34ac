"""Expert and router weights of a Hugging Face MoE block, in moelora's layout.

transformers stores experts as fused 3-D parameters; `is_transposed` (or the family, for
Llama-4) says whether they are [E, out, in] (moelora's layout) or [E, in, out]. With
in_place=True the result holds views of the module's own tensors (strided where the layout
is transposed): the expert weights, the model's largest allocation, are never copied.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError
from ..weights import ExpertWeights

# model_type -> name of the fused first projection (gate+up, or up alone when non-gated).
W13_NAMES = {"nemotron_h": "up_proj"}
# Families whose experts store [E, in, out] without an is_transposed flag.
ALWAYS_TRANSPOSED = frozenset({"llama4_text"})


def _oriented(param: torch.Tensor, transposed: bool, in_place: bool) -> torch.Tensor:
    view = param.detach().transpose(1, 2) if transposed else param.detach()
    return view if in_place else view.contiguous()


def is_transposed(experts: nn.Module, model: ModelConfig) -> bool:
    """True when the module stores [E, in, out] (gpt-oss, Llama-4)."""
    return bool(getattr(experts, "is_transposed", False)) or model.model_type in ALWAYS_TRANSPOSED


def expert_weights_from_hf(
    experts: nn.Module, model: ModelConfig, *, in_place: bool = False
) -> ExpertWeights:
    """ExpertWeights (w13 [E, S*I, H], w2 [E, H, I], biases) from an HF experts module;
    in_place: views of the module's tensors (no copy) instead of contiguous copies."""
    transposed = is_transposed(experts, model)
    w13_name = W13_NAMES.get(model.model_type, "gate_up_proj")
    w13 = _oriented(getattr(experts, w13_name), transposed, in_place)
    w2 = _oriented(experts.down_proj, transposed, in_place)
    shape = model.shape
    want13 = (shape.num_experts, shape.w13_rows, shape.hidden_size)
    want2 = (shape.num_experts, shape.hidden_size, shape.intermediate_size)
    if tuple(w13.shape) != want13 or tuple(w2.shape) != want2:
        raise ConfigError(
            "experts weights",
            f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}",
            f"w13 {want13}, w2 {want2} from the config",
            "pass the ModelConfig parsed from this model's own config",
        )
    b13 = getattr(experts, "gate_up_proj_bias", None)
    b2 = getattr(experts, "down_proj_bias", None)
    return ExpertWeights(
        w13=w13,
        w2=w2,
        b13=None if b13 is None else b13.detach(),
        b2=None if b2 is None else b2.detach(),
    )


def router_from_hf(block: nn.Module) -> tuple[nn.Module, torch.Tensor | None]:
    """(router module with .weight [E, H] and optional .bias, correction bias [E] or None)."""
    router = getattr(block, "gate", None) or getattr(block, "router", None)
    if router is None or not hasattr(router, "weight"):
        raise ConfigError("block", type(block).__name__, "an HF MoE block with .gate or .router")
    return router, getattr(router, "e_score_correction_bias", None)


def router_logits(block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Router logits [T, E] in fp32, computed as the HF router does (weight and bias)."""
    router, _ = router_from_hf(block)
    bias = getattr(router, "bias", None)
    return nn.functional.linear(
        hidden.float(), router.weight.float(), None if bias is None else bias.float()
    )
