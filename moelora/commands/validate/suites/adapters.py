"""Random adapters as `load_adapter` returns them (fp32, on the CPU), for the check suites.

Legend: E experts, S 2 gated / 1 not, H hidden, I intermediate, r the adapter's rank.
"""

from __future__ import annotations

import torch

from ....config import ModelConfig
from ....lora import Adapter, LayerLoRA


def random_adapter(
    model: ModelConfig, name: str, rank: int, seed: int, device: str = "cpu", offset: float = 0.0
) -> Adapter:
    """Rank-r factors on every MoE layer, drawn on `device` (fast for big models) and kept on
    the CPU: w13_a [E, S, r, H], w13_b [E, S, I, r], w2_a [E, r, I], w2_b [E, H, r], each
    scaled by 1/sqrt(fan in) so the delta stays comparable to the base output; `offset`
    shifts them off zero (a check that must tell them from an empty slot)."""
    sh = model.shape
    e, s, h, i = sh.num_experts, sh.activation.width_factor, sh.hidden_size, sh.intermediate_size
    shapes = ((e, s, rank, h), (e, s, i, rank), (e, rank, i), (e, h, rank))
    fans = (h, rank, i, rank)
    g = torch.Generator(device=device).manual_seed(seed)
    layers = {
        layer: LayerLoRA(
            *(
                (torch.randn(dims, generator=g, device=device) / fan**0.5 + offset).cpu()
                for dims, fan in zip(shapes, fans)
            )
        )
        for layer in model.moe_layers
    }
    return Adapter(name, "<memory>", rank, "per_expert", layers, model.shape)
