"""FP8 weights read from transformers modules that keep them in FP8 (an FP8 checkpoint
loaded on a GPU of compute capability >= 8.9).

Experts (fp8_experts_from_module): on a GPU of
compute capability >= 8.9, transformers 5.24 loads an FP8 checkpoint's fused experts as
e4m3 `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] with fp32 `gate_up_proj_scale_inv`
and `down_proj_scale_inv` (integrations/finegrained_fp8.py); elsewhere it dequantizes them
and this returns None (read the checkpoint instead: quant/checkpoint.py).

The result views the module's own tensors: nothing is copied.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import WeightsError
from ..quantization import FP8_MAX_STEP, FP8_MIN_STEP, QuantConfig
from .checkpoint import read_fp8_experts
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


def fp8_experts_for_layer(
    experts: nn.Module, model: ModelConfig, layer: int, model_dir: str | Path | None
) -> FP8ExpertWeights:
    """What `moelora.hf.attach` serves for MoE layer `layer` of a model whose config is FP8
    (model.quantization): the module's own e4m3 tensors where transformers kept them,
    else the experts read from `model_dir`'s safetensors (transformers dequantized them:
    a CPU, or a GPU below sm89). Raises WeightsError naming what is missing."""
    found = fp8_experts_from_module(experts, model.quantization)
    if found is not None:
        return found
    if model_dir is None or not Path(model_dir).is_dir():
        raise WeightsError(
            str(model_dir), "model directory", "none on disk",
            "the FP8 checkpoint's directory (transformers holds these experts dequantized)",
            "load the model from a local directory, or pass its path",
        )  # fmt: skip
    return read_fp8_experts(model_dir, model, layer)


def fp8_block(module: nn.Module) -> tuple[int, int] | None:
    """The scale block (bn, bk) of a Linear holding e4m3 weights with fp32 block scales
    `weight_scale_inv` and dynamic activation quantization (transformers' FP8Linear of a
    `quant_method: fp8` checkpoint, which keeps its tensors: nothing is copied); None for
    any other module (a plain Linear, per-tensor scales, static activation scales, an
    activation group that is not a power of two from 32 to 256: an FP8 dot's K step)."""
    if not isinstance(module, nn.Linear) or module.weight.dtype != torch.float8_e4m3fn:
        return None
    block = getattr(module, "block_size", None)
    scale = getattr(module, "weight_scale_inv", None)
    if block is None or scale is None or scale.dtype != torch.float32:
        return None
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        return None
    bn, bk = (int(b) for b in block)
    if bk & (bk - 1) or not FP8_MIN_STEP <= bk <= FP8_MAX_STEP:  # one dot step per group
        return None
    return bn, bk


def dequantize_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
                     ) -> torch.Tensor:  # fmt: skip
    """weight [N, K] e4m3 times its fp32 block scales [ceil(N / bn), ceil(K / bk)] -> fp32
    [N, K] (exact: an e4m3 value times an fp32 scale is one fp32 rounding at most)."""
    full = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return weight.float() * full[: weight.shape[0], : weight.shape[1]]
