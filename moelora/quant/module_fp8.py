"""FP8 experts from a transformers experts module that keeps them in FP8: on a GPU of
compute capability >= 8.9, transformers 5.24 loads an FP8 checkpoint's fused experts as
e4m3 `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] with fp32 `gate_up_proj_scale_inv`
and `down_proj_scale_inv` (integrations/finegrained_fp8.py); elsewhere it dequantizes them
and this returns None (read the checkpoint instead: quant/checkpoint.py).

The result views the module's own tensors: nothing is copied.
"""

from __future__ import annotations

import torch
from torch import nn

from .formats import QuantConfig
from .fp8_experts import FP8ExpertWeights


def fp8_experts_from_module(experts: nn.Module, quant: QuantConfig) -> FP8ExpertWeights | None:
    """FP8ExpertWeights viewing `experts`' e4m3 tensors and scales (checked as any
    container), or None when the module holds its experts dequantized."""
    w13 = getattr(experts, "gate_up_proj", None)
    if w13 is None or w13.dtype != torch.float8_e4m3fn:
        return None
    name = type(experts).__name__
    return FP8ExpertWeights(
        quant,
        w13.detach(),
        experts.down_proj.detach(),
        _scale(experts, "gate_up_proj_scale_inv"),
        _scale(experts, "down_proj_scale_inv"),
        source=f"transformers module {name}",
    )


def _scale(experts: nn.Module, name: str) -> torch.Tensor | None:
    t = getattr(experts, name, None)
    return None if t is None else t.detach()
