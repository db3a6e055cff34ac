"""Write an adapter as a PEFT directory (per-expert module keys, safetensors): what
`moelora demo` uses to go through the real loading path, and a way to hand moelora's
adapters to other tools."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import ModelConfig
from .adapter import LayerLoRA

KEY = "base_model.model.model.layers.{layer}.mlp.experts.{expert}.{proj}.lora_{ab}.weight"


def _projections(model: ModelConfig) -> list[tuple[str, str, int]]:
    """(PEFT module name, bank, part) per trained projection of this model family."""
    if model.shape.activation.is_gated:
        return [("gate_proj", "w13", 0), ("up_proj", "w13", 1), ("down_proj", "w2", 0)]
    return [("up_proj", "w13", 0), ("down_proj", "w2", 0)]


def save_adapter(
    path: str | Path,
    model: ModelConfig,
    layers: dict[int, LayerLoRA],
    rank: int,
    alpha: float | None = None,
) -> Path:
    """Write adapter_config.json + adapter_model.safetensors. B is stored divided by the
    PEFT scale alpha / rank, so loading folds the scale back in exactly once."""
    from safetensors.torch import save_file

    alpha = float(rank if alpha is None else alpha)
    scale = alpha / rank
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    projections = _projections(model)
    for layer, lora in layers.items():
        for expert in range(model.shape.num_experts):
            for proj, bank, part in projections:
                a = lora.w13_a[expert, part] if bank == "w13" else lora.w2_a[expert]
                b = lora.w13_b[expert, part] if bank == "w13" else lora.w2_b[expert]
                fmt = {"layer": layer, "expert": expert, "proj": proj}
                tensors[KEY.format(ab="A", **fmt)] = a[:rank].clone()
                tensors[KEY.format(ab="B", **fmt)] = (b[:, :rank] / scale).clone()
    save_file(tensors, str(root / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": False,
        "target_modules": sorted({p for p, _, _ in projections}), "rank_pattern": {},
        "alpha_pattern": {}, "lora_dropout": 0.0, "bias": "none",
    }  # fmt: skip
    (root / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return root
