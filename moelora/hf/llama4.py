"""Llama 4: the one family whose transformers experts do not go through ExpertsInterface.

Llama4TextMoe computes every expert densely on inputs pre-scaled by the router
(`experts(routed_in)`), so no experts implementation can be registered for it. moelora swaps
each such block for `Llama4MoELoRABlock`, a module that holds the block's own router, shared
expert and experts (same objects, same parameter names) and calls the block's own router,
then moelora's experts with top-1 weights on the input (SPEC.md, Llama-4 routing), then the
shared expert; it returns what the original block returns.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from . import experts as experts_impl

FAMILY = "llama4_text"


class Llama4MoELoRABlock(nn.Module):
    """Drop-in for Llama4TextMoe: (out [T, H], router_logits [T, E])."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.top_k = block.top_k
        self.hidden_dim = block.hidden_dim
        self.num_experts = block.num_experts
        self.experts = block.experts
        self.router = block.router
        self.shared_expert = block.shared_expert

    def forward(self, hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, self.hidden_dim)
        scores, logits = self.router(hidden)  # the model's own routing: [T, E] sigmoid scores
        weights, ids = torch.topk(scores, self.top_k, dim=1)
        routed = experts_impl.experts_forward(self.experts, hidden, ids, weights)
        out = self.shared_expert(hidden)
        out.add_(routed)
        return out, logits


def swap_llama4_blocks(model: nn.Module, model_config: ModelConfig) -> list[tuple]:
    """Replace every Llama4TextMoe of a Llama 4 model; returns (parent, name, original) per
    swapped block (empty for other families, which use ExpertsInterface)."""
    if model_config.model_type != FAMILY:
        return []
    swapped = []
    for module in list(model.modules()):
        block = getattr(module, "feed_forward", None)
        if block is not None and type(block).__name__ == "Llama4TextMoe":
            module.feed_forward = Llama4MoELoRABlock(block)
            swapped.append((module, "feed_forward", block))
    return swapped
