"""Read one MoE layer's FP8 experts and their scales from a model directory's safetensors,
for a config whose `quantization_config` is FP8 (config.from_hf reads the format).

Why read the files: transformers 5.24 dequantizes a pre-quantized FP8 checkpoint to bf16
when no GPU of compute capability >= 8.9 is present (FineGrainedFP8HfQuantizer.
validate_environment), so on a CPU its experts module holds no FP8 tensors. Two layouts:
  per expert (the published checkpoints: DeepSeek-V3, Qwen3-*-FP8)
    {prefix}.{layer}.mlp.experts.{e}.{gate,up,down}_proj.weight [N, K] e4m3
    {prefix}.{layer}.mlp.experts.{e}.{gate,up,down}_proj.weight_scale_inv
  fused (as transformers saves its FP8 experts)
    {prefix}.{layer}.mlp.experts.gate_up_proj [E, 2I, H], .gate_up_proj_scale_inv
    {prefix}.{layer}.mlp.experts.down_proj [E, H, I], .down_proj_scale_inv
Every tensor is checked (dtype, scale present, shape, finite positive) before the
container is built: a refusal names the file and key and keeps nothing.

Legend: E experts, H hidden, I intermediate, bn x bk the scale block.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from ..config import ModelConfig
from ..errors import WeightsError
from ..quantization import Quantization
from .fp8_experts import FP8ExpertWeights, checked_fp8_pair

INDEX = "model.safetensors.index.json"


class _Files:
    """name -> the safetensors file holding it, for a model directory (index or files)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        index = root / INDEX
        if index.is_file():
            self.where = {
                k: root / f for k, f in json.loads(index.read_text())["weight_map"].items()
            }
        else:
            self.where = {}
            for path in sorted(root.glob("*.safetensors")):
                self.where.update(dict.fromkeys(_keys(path), path))
        if not self.where:
            raise WeightsError(
                str(root), "*.safetensors", "no weights", "a model directory's safetensors"
            )

    def has(self, key: str) -> bool:
        return key in self.where

    def file(self, key: str) -> str:
        return str(self.where.get(key, self.root))

    def get(self, key: str) -> Tensor | None:
        from safetensors import safe_open

        if key not in self.where:
            return None
        with safe_open(str(self.where[key]), framework="pt") as f:
            return f.get_tensor(key)


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def _pair(files: _Files, model: ModelConfig, key: str, scale_key: str) -> tuple[Tensor, Tensor]:
    """One e4m3 weight and its canonical scale, checked; WeightsError naming file and key."""
    weight = files.get(key)
    if weight is None:
        raise WeightsError(
            files.file(key), key, "no tensor", "an e4m3 expert weight", "check the layer prefix"
        )
    batched = weight.dim() == 2  # per expert: [N, K] -> [1, N, K]
    w = weight[None] if batched else weight
    scale = files.get(scale_key)
    if scale is not None and batched:
        scale = scale[None]
    scale = checked_fp8_pair(model.quantization, files.file(scale_key), key, w, scale_key, scale)
    return w, scale


def read_fp8_experts(
    model_dir: str | Path, model: ModelConfig, layer: int, prefix: str = "model.layers"
) -> FP8ExpertWeights:
    """The FP8 experts of MoE layer `layer` (w13 [E, 2I, H] gate rows first, w2 [E, H, I])
    with their scales, from `model_dir`'s safetensors; `model`: its config.from_hf (gated
    experts in an FP8 format). Raises WeightsError naming the file and key."""
    quant = model.quantization
    if not quant.method.is_fp8:
        raise WeightsError(
            str(model_dir), "quantization_config", quant.method.value, "an FP8 format"
        )
    files = _Files(Path(model_dir))
    base = f"{prefix}.{layer}.mlp.experts"
    if files.has(f"{base}.gate_up_proj"):
        w13, s13 = _pair(files, model, f"{base}.gate_up_proj", f"{base}.gate_up_proj_scale_inv")
        w2, s2 = _pair(files, model, f"{base}.down_proj", f"{base}.down_proj_scale_inv")
    else:
        w13, s13, w2, s2 = _per_expert(files, model, base)
    return FP8ExpertWeights(
        quant, w13, w2, s13, s2, source=files.file(f"{base}.0.down_proj.weight")
    )


def _per_expert(files: _Files, model: ModelConfig, base: str) -> tuple[Tensor, ...]:
    """Stack each expert's gate, up and down tensors: gate and up rows (and their scale
    rows) concatenated, which needs I to be a whole number of scale blocks."""
    inter, bn = model.shape.intermediate_size, model.quantization.block[0]
    if model.quantization.method is Quantization.FP8_BLOCK and inter % bn:
        key = f"{base}.0.gate_proj.weight_scale_inv"
        raise WeightsError(
            files.file(key), key, f"I = {inter} rows in blocks of {bn}",
            "I a multiple of the block's rows (gate and up scale rows are joined)",
            "re-quantize with a weight_block_size that divides intermediate_size",
        )  # fmt: skip
    w13, s13, w2, s2 = [], [], [], []
    for e in range(model.shape.num_experts):
        parts = [
            _pair(files, model, f"{base}.{e}.{p}.weight", f"{base}.{e}.{p}.weight_scale_inv")
            for p in ("gate_proj", "up_proj", "down_proj")
        ]
        w13.append(torch.cat([parts[0][0], parts[1][0]], dim=1))
        s13.append(torch.cat([parts[0][1], parts[1][1]], dim=1))
        w2.append(parts[2][0])
        s2.append(parts[2][1])
    return torch.cat(w13), torch.cat(s13), torch.cat(w2), torch.cat(s2)
