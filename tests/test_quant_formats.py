"""FP8 formats as data: the quantization_config table, the FP8 expert container's
refusals (each names the key, what was found and expected), and quantize -> dequantize
against an fp64 per-block / per-row computation written here."""

from __future__ import annotations

import pytest
import torch

from moelora import MoEShape, random_expert_weights
from moelora.compare import assert_close
from moelora.errors import ConfigError, WeightsError
from moelora.quant.fp8_experts import FP8ExpertWeights, quantize_experts
from moelora.quantization import QuantConfig, Quantization, from_hf_quantization

BLOCK, CHANNEL = QuantConfig(Quantization.FP8_BLOCK), QuantConfig(Quantization.FP8_CHANNEL)

# (id, quantization_config, expected method, block) - as transformers writes them
HF_CASES = [
    ("none", None, Quantization.NONE, (128, 128)),
    ("deepseek_v3", {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                     "weight_block_size": [128, 128]}, Quantization.FP8_BLOCK, (128, 128)),
    ("block_64", {"quant_method": "fp8", "weight_block_size": [64, 128]},
     Quantization.FP8_BLOCK, (64, 128)),  # another block size is read, not assumed
    ("per_channel", {"quant_method": "fp8", "activation_scheme": "dynamic"},
     Quantization.FP8_CHANNEL, (128, 128)),  # no block: per-channel W8A8
]  # fmt: skip


@pytest.mark.parametrize("name,qc,method,block", HF_CASES, ids=[c[0] for c in HF_CASES])
def test_from_hf_quantization(name, qc, method, block) -> None:
    got = from_hf_quantization(qc)
    assert (got.method, got.block) == (method, block)


# (id, quantization_config, key the error names, words of the fix)
REFUSED = [
    ("e5m2", {"quant_method": "fp8", "fmt": "e5m2"}, "quantization_config.fmt", "e4m3"),
    ("mxfp4", {"quant_method": "mxfp4"}, "quantization_config.quant_method", "MXFP4"),
    ("nvfp4", {"quant_method": "modelopt", "quant_algo": "NVFP4"},
     "quantization_config.quant_algo", "FP8"),
    ("static_act", {"quant_method": "fp8", "activation_scheme": "static"},
     "quantization_config.activation_scheme", "dynamic"),
    ("awq", {"quant_method": "awq"}, "quantization_config.quant_method", "FP8"),
]  # fmt: skip


@pytest.mark.parametrize("name,qc,key,fix", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_formats_name_the_key_and_fix(name, qc, key, fix) -> None:
    with pytest.raises(ConfigError) as err:
        from_hf_quantization(qc)
    assert err.value.key == key and fix in err.value.fix


SHAPE = MoEShape(num_experts=3, top_k=2, hidden_size=160, intermediate_size=96, activation="silu")


def _fp8(quant: QuantConfig, seed: int) -> FP8ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    return quantize_experts(random_expert_weights(SHAPE, generator=g, dtype=torch.float32), quant)


def _bad(fp8: FP8ExpertWeights, **changes) -> dict:
    fields = {k: getattr(fp8, k) for k in ("quant", "w13", "w2", "w13_scale", "w2_scale")}
    return {**fields, **changes}


# (id, format, change to one field, key named, words of what was found)
BAD_INPUT = [
    ("missing_scale", BLOCK, lambda f: {"w2_scale": None}, "w2_scale", "no tensor"),
    ("block_mismatch", BLOCK, lambda f: {"w13_scale": f.w13_scale[:, :1]}, "w13_scale", "shape"),
    ("nan_scale", BLOCK, lambda f: {"w13_scale": _with(f.w13_scale, float("nan"))}, "w13_scale",
     "nan"),
    ("inf_scale", CHANNEL, lambda f: {"w2_scale": _with(f.w2_scale, float("inf"))}, "w2_scale",
     "inf"),
    ("zero_scale", CHANNEL, lambda f: {"w2_scale": _with(f.w2_scale, 0.0)}, "w2_scale", "0.0"),
    ("e5m2", BLOCK, lambda f: {"w13": f.w13.to(torch.float8_e5m2)}, "w13", "float8_e5m2"),
    ("bf16_weight", CHANNEL, lambda f: {"w2": f.w2.to(torch.bfloat16)}, "w2", "bfloat16"),
    ("channel_rows", CHANNEL, lambda f: {"w13_scale": f.w13_scale[:, :-1]}, "w13_scale", "shape"),
]  # fmt: skip


def _with(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[t.numel() // 2] = value
    return t


@pytest.mark.parametrize("name,quant,change,key,found", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_container_refuses_bad_input(name, quant, change, key, found, seed) -> None:
    fp8 = _fp8(quant, seed)
    before = fp8.w13_scale.clone()
    with pytest.raises(WeightsError) as err:
        FP8ExpertWeights(**_bad(fp8, **change(fp8)))
    assert err.value.key == key and found in str(err.value.found), err.value
    assert torch.equal(fp8.w13_scale, before)  # the refused build changed nothing it was given


def test_per_tensor_scales_broadcast_to_rows(seed) -> None:
    fp8 = _fp8(CHANNEL, seed)
    per_tensor = torch.rand(SHAPE.num_experts) + 0.5
    out = FP8ExpertWeights(**_bad(fp8, w2_scale=per_tensor))
    assert torch.equal(out.w2_scale, per_tensor[:, None].expand(-1, SHAPE.hidden_size))


def _dequant64(w: torch.Tensor, scale: torch.Tensor, quant: QuantConfig) -> torch.Tensor:
    """Element by block index, written out: w[e, n, k] * scale[e, n // bn, k // bk]."""
    e, n, k = w.shape
    out = torch.empty(e, n, k, dtype=torch.float64)
    for row in range(n):
        s = scale[:, row // quant.block[0]] if quant is BLOCK else scale[:, row : row + 1]
        cols = torch.arange(k) // quant.block[1] if quant is BLOCK else torch.zeros(k, dtype=int)
        out[:, row] = w[:, row].double() * s.double()[:, cols]
    return out


@pytest.mark.parametrize("quant", [BLOCK, CHANNEL], ids=["block", "channel"])
def test_quantize_dequantize_round_trip(quant, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    full = random_expert_weights(SHAPE, generator=g, dtype=torch.float32)
    fp8 = quantize_experts(full, quant)
    deq = fp8.dequantize()
    assert deq.quantization == quant  # the reference quantizes activations by its groups
    for name in ("w13", "w2"):
        ref = _dequant64(getattr(fp8, name), getattr(fp8, f"{name}_scale"), quant)
        assert_close(getattr(deq, name), ref, tol=1e-7, what=name)  # one fp32 rounding
        # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 per element
        err = (ref - getattr(full, name).double()).norm() / getattr(full, name).double().norm()
        assert 1e-3 < err < 0.0625, err  # quantized (not a copy), and close
