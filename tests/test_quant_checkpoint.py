"""FP8 experts read from a model directory's safetensors, in both layouts (per expert, as
published; fused, as transformers saves), against the tensors written; each bad file
refused naming the file and key, nothing returned half-read."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from moelora import random_expert_weights
from moelora.config import from_hf
from moelora.errors import WeightsError
from moelora.presets import preset_dict
from moelora.quant.checkpoint import read_fp8_experts
from moelora.quant.fp8_experts import quantize_experts

BLOCK_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [16, 32]}  # fmt: skip
CHANNEL_QC = {"quant_method": "fp8", "activation_scheme": "dynamic"}
LAYER = 1
BASE = f"model.layers.{LAYER}.mlp.experts"


def _model(qc: dict):
    return from_hf(preset_dict("tiny") | {"quantization_config": qc}, "tiny-fp8")


def _per_expert(fp8, inter: int) -> dict[str, torch.Tensor]:
    """The published layout: gate rows [0, I), up rows [I, 2I) of w13, each expert apart."""
    blocked = fp8.w13_scale.dim() == 3
    rows13 = inter // fp8.quant.block[0] if blocked else inter
    out = {}
    for e in range(fp8.w13.shape[0]):
        parts = {
            "gate_proj": (fp8.w13[e, :inter], fp8.w13_scale[e, :rows13]),
            "up_proj": (fp8.w13[e, inter:], fp8.w13_scale[e, rows13:]),
            "down_proj": (fp8.w2[e], fp8.w2_scale[e]),
        }
        for name, (w, s) in parts.items():
            out[f"{BASE}.{e}.{name}.weight"] = w.contiguous()
            out[f"{BASE}.{e}.{name}.weight_scale_inv"] = s.contiguous()
    return out


def _fused(fp8) -> dict[str, torch.Tensor]:
    return {
        f"{BASE}.gate_up_proj": fp8.w13,
        f"{BASE}.gate_up_proj_scale_inv": fp8.w13_scale,
        f"{BASE}.down_proj": fp8.w2,
        f"{BASE}.down_proj_scale_inv": fp8.w2_scale,
    }


def _write(tmp_path, qc: dict, tensors: dict) -> str:
    (tmp_path / "config.json").write_text(
        json.dumps(preset_dict("tiny") | {"quantization_config": qc})
    )
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def _fp8(qc: dict, seed: int):
    model = _model(qc)
    g = torch.Generator().manual_seed(seed)
    full = random_expert_weights(model.shape, generator=g, dtype=torch.float32)
    return model, quantize_experts(full, model.quantization)


# (id, quantization_config, layout)
LAYOUTS = [
    ("block_per_expert", BLOCK_QC, "per_expert"),
    ("block_fused", BLOCK_QC, "fused"),
    ("channel_per_expert", CHANNEL_QC, "per_expert"),
]


@pytest.mark.parametrize("name,qc,layout", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_reads_what_was_written(name, qc, layout, tmp_path, seed) -> None:
    model, fp8 = _fp8(qc, seed)
    inter = model.shape.intermediate_size
    tensors = _per_expert(fp8, inter) if layout == "per_expert" else _fused(fp8)
    got = read_fp8_experts(_write(tmp_path, qc, tensors), model, LAYER)
    for key in ("w13", "w2", "w13_scale", "w2_scale"):
        assert torch.equal(getattr(got, key).float(), getattr(fp8, key).float()), key


def _drop(tensors: dict, key: str) -> dict:
    return {k: v for k, v in tensors.items() if k != key}


def _set(tensors: dict, key: str, value) -> dict:
    return {**tensors, key: value}


S0 = f"{BASE}.0.down_proj.weight_scale_inv"
# (id, change to the per-expert files, key named, words of what was found)
BAD_FILES = [
    ("missing_scale", lambda t: _drop(t, S0), S0, "no tensor"),
    ("missing_weight", lambda t: _drop(t, f"{BASE}.3.up_proj.weight"), f"{BASE}.3.up_proj.weight",
     "no tensor"),
    ("scale_vs_block", lambda t: _set(t, S0, t[S0][:1].contiguous()), S0, "shape"),
    ("nan_scale", lambda t: _set(t, S0, t[S0].clone().fill_(float("nan"))), S0, "nan"),
    ("inf_scale", lambda t: _set(t, S0, t[S0].clone().fill_(float("inf"))), S0, "inf"),
    ("e5m2_weight", lambda t: _set(t, f"{BASE}.2.gate_proj.weight",
                                   t[f"{BASE}.2.gate_proj.weight"].to(torch.float8_e5m2)),
     f"{BASE}.2.gate_proj.weight", "float8_e5m2"),
]  # fmt: skip


@pytest.mark.parametrize("name,change,key,found", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_bad_files_refused_naming_file_and_key(name, change, key, found, tmp_path, seed) -> None:
    model, fp8 = _fp8(BLOCK_QC, seed)
    root = _write(tmp_path, BLOCK_QC, change(_per_expert(fp8, model.shape.intermediate_size)))
    with pytest.raises(WeightsError) as err:
        read_fp8_experts(root, model, LAYER)
    assert err.value.key == key and found in str(err.value.found), err.value
    assert str(tmp_path) in err.value.file


def test_block_rows_must_divide_the_intermediate_size(tmp_path, seed) -> None:
    qc = BLOCK_QC | {"weight_block_size": [24, 32]}  # I = 32: gate / up scale rows can't join
    model, fp8 = _fp8(BLOCK_QC, seed)
    root = _write(tmp_path, qc, _per_expert(fp8, model.shape.intermediate_size))
    with pytest.raises(WeightsError) as err:
        read_fp8_experts(root, _model(qc), LAYER)
    assert "weight_block_size" in err.value.fix


def test_matches_transformers_own_dequantization(tmp_path, seed) -> None:
    """transformers 5.24 on a CPU dequantizes an FP8 checkpoint's experts to bf16: what the
    reader returns, dequantized, equals them (to bf16 rounding) on a checkpoint written by
    transformers and quantized here."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from moelora.compare import assert_close

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    model = from_hf(cfg.to_dict() | {"quantization_config": BLOCK_QC}, "hf-fp8")
    for key in [k for k in tensors if ".mlp.experts." in k]:
        q = quantize_experts_one(tensors[key].float().normal_(), model)
        tensors[key], tensors[key + "_scale_inv"] = q
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"quantization_config": BLOCK_QC}))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).model.layers[LAYER].mlp.experts
    assert hf.gate_up_proj.dtype == torch.bfloat16  # dequantized by transformers on a CPU
    deq = read_fp8_experts(tmp_path, model, LAYER).dequantize()
    assert_close(hf.gate_up_proj, deq.w13, torch.bfloat16, what="gate_up")
    assert_close(hf.down_proj, deq.w2, torch.bfloat16, what="down")


def quantize_experts_one(w: torch.Tensor, model) -> tuple[torch.Tensor, torch.Tensor]:
    """One [N, K] expert tensor -> (e4m3, scale_inv) in the model's block format."""
    from moelora.weights import ExpertWeights

    fp8 = quantize_experts(ExpertWeights(w[None], w[None]), model.quantization)
    return fp8.w13[0].contiguous(), fp8.w13_scale[0].contiguous()


def test_module_in_fp8_is_viewed_and_a_dequantized_one_is_not(seed) -> None:
    """transformers' FP8Experts attribute layout (e4m3 gate_up_proj / down_proj with
    *_scale_inv); a module holding bf16 experts gives None (read the checkpoint)."""
    from torch import nn

    from moelora.errors import WeightsError
    from moelora.quant.module_fp8 import fp8_experts_from_module

    model, fp8 = _fp8(BLOCK_QC, seed)
    module = nn.Module()
    module.gate_up_proj = nn.Parameter(fp8.w13, requires_grad=False)
    module.down_proj = nn.Parameter(fp8.w2, requires_grad=False)
    module.gate_up_proj_scale_inv = nn.Parameter(fp8.w13_scale, requires_grad=False)
    module.down_proj_scale_inv = nn.Parameter(fp8.w2_scale, requires_grad=False)
    got = fp8_experts_from_module(module, model.quantization)
    assert got.w13.data_ptr() == fp8.w13.data_ptr()  # a view, not a copy
    assert torch.equal(got.w2_scale, fp8.w2_scale)
    del module.down_proj_scale_inv
    with pytest.raises(WeightsError) as err:
        fp8_experts_from_module(module, model.quantization)
    assert err.value.key == "w2_scale"
    module.gate_up_proj = nn.Parameter(fp8.w13.to(torch.bfloat16), requires_grad=False)
    assert fp8_experts_from_module(module, model.quantization) is None


def test_layer_experts_come_from_the_module_or_else_the_files(tmp_path, seed) -> None:
    from torch import nn

    from moelora.quant.module_fp8 import fp8_experts_for_layer

    model, fp8 = _fp8(BLOCK_QC, seed)
    root = _write(tmp_path, BLOCK_QC, _fused(fp8))
    dequantized = nn.Module()  # what transformers holds on a CPU: bf16 experts
    dequantized.gate_up_proj = nn.Parameter(fp8.w13.to(torch.bfloat16), requires_grad=False)
    got = fp8_experts_for_layer(dequantized, model, LAYER, root)
    assert torch.equal(got.w13.float(), fp8.w13.float()) and str(tmp_path) in got.source
    with pytest.raises(WeightsError) as err:
        fp8_experts_for_layer(dequantized, model, LAYER, None)
    assert err.value.key == "model directory"
