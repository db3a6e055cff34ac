"""FP8 experts in the oracle: the `quantization` field of a deployment against each
backend's record (the one check, reasons never raised), `moelora plan --quantization`
reading the block size from a config's quantization_config, explicit refusal naming the
field, auto picking a backend that has it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from oracle_doubles import TRITON_LIKE

from moelora import cli
from moelora.backends.capabilities import FULL_PRECISION_ONLY
from moelora.backends.checks import check
from moelora.backends.reference import CAPABILITIES as REFERENCE_CAPS
from moelora.deployment import Deployment
from moelora.device import target
from moelora.errors import UnsupportedDeploymentError
from moelora.oracle import select
from moelora.presets import load_preset, preset_dict
from moelora.quantization import QuantConfig, Quantization

BLOCK = QuantConfig(Quantization.FP8_BLOCK)
NO_FP8 = dataclasses.replace(TRITON_LIKE.capabilities, quantizations=FULL_PRECISION_ONLY)
# a record that runs block FP8 from sm89 (the e4m3 tensor-core MMA) and nothing else FP8
SM89_BLOCK = dataclasses.replace(
    TRITON_LIKE.capabilities,
    quantizations={Quantization.NONE: None, Quantization.FP8_BLOCK: (8, 9)},
)


def _dep(quant: QuantConfig, device: str = "h200", backend: str = "auto") -> Deployment:
    model = load_preset("qwen3-30b-a3b")
    return Deployment.for_model(
        model, device=target(device), backend=backend, quantization=quant.method.value
    )


# (id, record, quantization, device, expected (field, value) of the reasons)
CHECK_CASES = [
    ("none_everywhere", NO_FP8, QuantConfig(), "a100", []),
    ("fp8_lacking", NO_FP8, BLOCK, "h200", [("quantization", "fp8_block")]),
    ("fp8_sm90_ok", SM89_BLOCK, BLOCK, "h200", []),
    ("fp8_sm80_too_old", SM89_BLOCK, BLOCK, "a100", [("device.compute_capability", "8.0")]),
    ("channel_absent", SM89_BLOCK, QuantConfig(Quantization.FP8_CHANNEL), "h200",
     [("quantization", "fp8_channel")]),  # block support says nothing of per-channel
    ("reference_all", REFERENCE_CAPS, QuantConfig(Quantization.FP8_CHANNEL), "a100", []),
]  # fmt: skip


@pytest.mark.parametrize("name,cap,quant,device,want", CHECK_CASES, ids=[c[0] for c in CHECK_CASES])
def test_quantization_check(name, cap, quant, device, want) -> None:
    reasons = [
        (r.field, r.value) for r in check(cap, _dep(quant, device)) if r.field != "cuda_graphs"
    ]
    assert reasons == want


CHANNEL = QuantConfig(Quantization.FP8_CHANNEL)
# (id, format, device, explicit backend lacking it, the field it is refused on)
REFUSALS = [
    ("grouped_mm_block", BLOCK, "h200", "grouped_mm", "quantization"),
    ("triton_channel_sm80", CHANNEL, "a100", "triton", "device.compute_capability"),
    ("triton_block_sm80", BLOCK, "a100", "triton", "device.compute_capability"),
]


@pytest.mark.parametrize("name,quant,device,backend,field", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_explicit_backend_lacking_fp8_is_refused_naming_the_field(
    name, quant, device, backend, field
) -> None:
    with pytest.raises(UnsupportedDeploymentError) as err:
        select(_dep(quant, device, backend=backend))
    assert [r.field for r in err.value.reasons[backend]] == [field]


# (id, format, device, cuda graphs, the backend auto picks)
AUTO = [
    ("block_h200_graphs", BLOCK, "h200", True, "triton"),
    ("channel_h200_graphs", CHANNEL, "h200", True, "triton"),
    ("channel_a100_eager", CHANNEL, "a100", False, "reference"),  # e4m3 MMA needs sm89
    ("block_a100_eager", BLOCK, "a100", False, "reference"),  # no e4m3 conversion on sm80
]


@pytest.mark.parametrize("name,quant,device,graphs,want", AUTO, ids=[c[0] for c in AUTO])
def test_auto_picks_a_backend_that_has_the_format(name, quant, device, graphs, want) -> None:
    selection = select(dataclasses.replace(_dep(quant, device), cuda_graphs=graphs))
    assert selection.name == want
    assert quant.method in selection.backend.capabilities.quantizations


def _model_dir(tmp_path, qc: dict | None) -> str:
    cfg = preset_dict("qwen3-30b-a3b") | ({"quantization_config": qc} if qc else {})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


# (id, quantization_config, flag, expected format, block)
PLAN_CASES = [
    ("config_block_64", {"quant_method": "fp8", "weight_block_size": [64, 128]}, "fp8",
     "fp8_block", [64, 128]),  # the flag takes the config's block
    ("config_read_by_default", {"quant_method": "fp8", "weight_block_size": [128, 128]}, None,
     "fp8_block", [128, 128]),  # as vLLM: the config's quantization_config applies unasked
    ("flag_on_bf16_config", None, "fp8", "fp8_block", [128, 128]),
    ("config_per_channel", {"quant_method": "fp8"}, "fp8", "fp8_channel", [128, 128]),
    ("none_overrides", {"quant_method": "fp8"}, "none", "none", [128, 128]),
]  # fmt: skip


@pytest.mark.parametrize("name,qc,flag,method,block", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_plan_reads_the_format(name, qc, flag, method, block, tmp_path, capsys) -> None:
    argv = ["plan", "--model", _model_dir(tmp_path, qc), "--device", "h200", "--enforce-eager"]
    code = cli.main(argv + (["--quantization", flag] if flag else []) + ["--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["deployment"]["quantization"] == method
    assert plan["deployment"]["quantization_block"] == block
    assert code == 0 and plan["selected"] == "triton"  # both FP8 formats run there


def test_plan_refuses_an_explicit_backend_and_a_bad_format(tmp_path, capsys) -> None:
    model = _model_dir(tmp_path, {"quant_method": "fp8"})
    code = cli.main(["plan", "--model", model, "--device", "h200", "--moe-backend", "grouped_mm"])
    out = capsys.readouterr().out
    assert code == 3 and "quantization = fp8_channel: needs one of none" in out
    e5m2 = _model_dir(tmp_path, {"quant_method": "fp8", "fmt": "e5m2"})
    assert cli.main(["plan", "--model", e5m2]) == 2
    assert "quantization_config.fmt" in capsys.readouterr().err


def test_fp8_is_reported_validated_only_where_an_fp8_run_was(tmp_path) -> None:
    from moelora.backends.checks import validation_status
    from moelora.backends.registry import REGISTRY

    triton = REGISTRY["triton"].capabilities
    # the W8A8 kernels passed validate on the H200 in bf16 (1d0ea3b; per-channel 0026125); no
    # other GPU ran them, nor fp16 serving on the H200
    assert validation_status(triton, _dep(BLOCK, "h200")).validated
    assert validation_status(triton, _dep(CHANNEL, "h200")).validated
    assert validation_status(triton, _dep(BLOCK, "b200")).level == "not_validated"
    h200 = _dep(BLOCK, "h200")
    fp16 = dataclasses.replace(h200, shape=dataclasses.replace(h200.shape, dtype=torch.float16))
    assert validation_status(triton, fp16).level == "other_dtype"
    assert validation_status(triton, _dep(QuantConfig(), "h200")).validated
    cpu = _dep(BLOCK, "cpu")
    cpu = dataclasses.replace(cpu, shape=dataclasses.replace(cpu.shape, dtype=torch.float32))
    assert validation_status(triton, cpu).validated  # tests/test_quant_triton.py, fp32


def test_fp8_experts_run_unsharded() -> None:
    from moelora.config import ParallelConfig
    from moelora.errors import ConfigError

    model = load_preset("qwen3-30b-a3b")
    with pytest.raises(ConfigError) as err:
        Deployment.for_model(
            model, device=target("h200"), parallel=ParallelConfig(tp=2), quantization="fp8"
        )
    assert err.value.key == "quantization" and "--quantization none" in err.value.fix
