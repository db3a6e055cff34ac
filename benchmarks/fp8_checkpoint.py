"""Write a bf16 transformers MoE model as an FP8 checkpoint directory: the routed experts
in e4m3 with fp32 `weight_scale_inv` of one value per bn x bk block (per expert, as the
published -FP8 checkpoints, or fused as transformers' FP8Experts hold them: LAYOUTS),
every other tensor as the model holds it, and a config whose quantization_config is
{quant_method fp8, fmt e4m3, activation_scheme dynamic, weight_block_size [bn, bk]}. One
safetensors file per layer's experts (quantized on the model's device one layer at a time)
plus one for the rest, with the index.

`modules_to_not_convert` names the Linear modules the checkpoint holds in bf16 without
scales, so transformers must not swap them for its FP8Linear (that would load bf16 values
into e4m3 parameters with no scales): every non-expert one, or with `attention` (as the
published checkpoints) all but q / k / v / o, which are then e4m3 with block scales too.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from moelora.quant.fp8_experts import quantize_experts
from moelora.quantization import QuantConfig, Quantization
from moelora.weights import ExpertWeights

# per_expert: `mlp.experts.{e}.{gate,up,down}_proj.weight` and `.weight_scale_inv`, as the
# published -FP8 checkpoints (transformers fuses them at load; on a CPU its dequantization
# reads this layout). fused: `mlp.experts.gate_up_proj` and `_scale_inv`, as transformers'
# FP8Experts hold them (transformers 5.24 on a CPU leaves these scales unread and loads the
# raw e4m3 values as the weights: use this layout on a GPU that keeps FP8Experts only).
LAYOUTS = ("per_expert", "fused")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
NOT_CONVERTED = ["lm_head", *ATTENTION, "mlp.gate"]


def _layer_tensors(fp8, base: str, layout: str, block: int) -> dict:
    """One layer's FP8 experts as checkpoint tensors in `layout`."""
    if layout == "fused":
        return {
            base + "gate_up_proj": fp8.w13, base + "gate_up_proj_scale_inv": fp8.w13_scale,
            base + "down_proj": fp8.w2, base + "down_proj_scale_inv": fp8.w2_scale,
        }  # fmt: skip
    inter = fp8.w2.shape[2]
    rows = inter // block  # gate scale rows; the up rows follow
    out = {}
    for e in range(fp8.w13.shape[0]):
        parts = {
            "gate_proj": (fp8.w13[e, :inter], fp8.w13_scale[e, :rows]),
            "up_proj": (fp8.w13[e, inter:], fp8.w13_scale[e, rows:]),
            "down_proj": (fp8.w2[e], fp8.w2_scale[e]),
        }
        for name, (w, scale) in parts.items():
            out[f"{base}{e}.{name}.weight"] = w
            out[f"{base}{e}.{name}.weight_scale_inv"] = scale
    return out


def quantization_config(block: int, attention: bool = False) -> dict:
    kept = [m for m in NOT_CONVERTED if not (attention and m in ATTENTION)]
    return {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [block, block], "modules_to_not_convert": kept,
    }  # fmt: skip


def quantize_block(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], fp32 weight_scale_inv [ceil(N / block), ceil(K / block)]):
    each block's amax maps to 448."""
    quant = QuantConfig(Quantization.FP8_BLOCK, (block, block))
    fp8 = quantize_experts(ExpertWeights(w[None], w.t()[None]), quant)  # w2 unused
    return fp8.w13[0], fp8.w13_scale[0]


def scratch_dir(need_bytes: int) -> Path:
    """A fresh directory on /dev/shm when it has room for `need_bytes` (the fastest place
    to write and read back), else in the temp directory."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 1.1 * need_bytes:
        return Path(tempfile.mkdtemp(dir=shm, prefix="moelora-fp8-"))
    return Path(tempfile.mkdtemp(prefix="moelora-fp8-"))


def write_fp8_checkpoint(
    model, root: Path, block: int, layout: str = "per_expert", attention: bool = False
) -> Path:
    """`model` (a bf16 Qwen3-MoE, experts fused) -> an FP8 checkpoint in `root`, the experts
    in `layout` (LAYOUTS); with `attention` q / k / v / o in e4m3 with block scales too."""
    from safetensors.torch import save_file

    quant = QuantConfig(Quantization.FP8_BLOCK, (block, block))
    root.mkdir(parents=True, exist_ok=True)
    where: dict[str, str] = {}
    rest = {}
    for key, tensor in model.state_dict().items():
        if ".mlp.experts." in key:
            continue
        module = key.rsplit(".", 2)
        if attention and module[-1] == "weight" and module[-2] in ATTENTION:
            with torch.no_grad():
                w, scale = quantize_block(tensor.detach(), block)
            rest[key] = w.to("cpu").contiguous()
            rest[key + "_scale_inv"] = scale.to("cpu").contiguous()
        else:
            rest[key] = tensor.detach().to("cpu").contiguous()
    save_file(rest, str(root / "rest.safetensors"), metadata={"format": "pt"})
    where.update(dict.fromkeys(rest, "rest.safetensors"))
    del rest
    for index, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        with torch.no_grad():
            full = ExpertWeights(experts.gate_up_proj.detach(), experts.down_proj.detach())
            fp8 = quantize_experts(full, quant)
        tensors = _layer_tensors(fp8, f"model.layers.{index}.mlp.experts.", layout, block)
        name = f"experts-{index:03d}.safetensors"
        save_file({k: v.to("cpu").contiguous() for k, v in tensors.items()}, str(root / name),
                  metadata={"format": "pt"})  # fmt: skip
        where.update(dict.fromkeys(tensors, name))
        del fp8, tensors
    index_doc = {"metadata": {}, "weight_map": where}
    (root / "model.safetensors.index.json").write_text(json.dumps(index_doc))
    config = model.config.to_dict() | {"quantization_config": quantization_config(block, attention)}
    config.pop("_experts_implementation", None)
    (root / "config.json").write_text(json.dumps(config, indent=1))
    return root
