"""select() details, the Deployment's derived facts and config errors, named device targets,
the registry, and the reference backend's forward contract (out / add_inputs)."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest
import torch
from oracle_doubles import LORA_ONLY, MIMIC, TRITON_LIKE, deploy

import moelora
from moelora import device as device_mod
from moelora.backends.base import Backend
from moelora.backends.registry import RANKING, REGISTRY
from moelora.call import MoECall
from moelora.compare import assert_close, poison_
from moelora.config import AddInputs, MoEShape
from moelora.deployment import LoRASharding, ParallelMode
from moelora.errors import ConfigError, UnsupportedDeploymentError
from moelora.oracle import select
from moelora.reference import moe_lora_reference
from moelora.weights import random_expert_weights, random_lora_bank

THREE = {"mimic": MIMIC, "triton": TRITON_LIKE, "reference": REGISTRY["reference"]}


def test_unknown_backend_name_is_a_config_error_listing_the_registered_ones():
    with pytest.raises(ConfigError) as err:
        select(deploy(backend="cutlass"), THREE)
    assert err.value.key == "moe_backend"
    assert "mimic, triton, reference" in str(err.value)


def test_one_info_line_names_selected_requested_how_and_every_other_reason(caplog):
    dep = deploy("nemotron-h", "h200", lora=True)  # relu2 on sm90: mimic fails on several fields
    with caplog.at_level(logging.INFO, logger="moelora.oracle"):
        select(dep, THREE)
    [record] = caplog.records
    line = record.getMessage()
    assert record.levelno == logging.INFO
    assert "selected triton, auto: the fastest backend that runs here" in line
    for text in (
        "mimic (device.compute_capability = 9.0",
        "activation = relu2_no_mul",
        "gating = non_gated",
    ):
        assert text in line
    assert "reference (runs, ranked below triton)" in line


def test_explicit_log_line_says_explicit_and_not_requested(caplog):
    with caplog.at_level(logging.INFO, logger="moelora.oracle"):
        select(deploy("qwen3-30b-a3b", "b200", backend="reference"), THREE)
    line = caplog.records[-1].getMessage()
    assert "selected reference, requested explicitly" in line
    assert "mimic (runs, not requested)" in line


# (id, --moe-backend, selected, words the selection line must hold) on a cpu with
# TRITON_INTERPRET=1: triton accepts there but runs through Triton's interpreter.
CPU_RANKING = [
    ("auto-ranks-interpreted-last", "auto", "reference",
     ["selected reference, auto", "triton would run interpreted on this cpu (slower)",
      "triton (runs, but interpreted here: slower)"]),
    ("explicit-triton-honoured", "triton", "triton",
     ["selected triton (interpreted: Triton's CPU interpreter, slow), requested explicitly"]),
]  # fmt: skip


@pytest.mark.parametrize("case", CPU_RANKING, ids=[c[0] for c in CPU_RANKING])
def test_auto_on_a_cpu_ranks_interpreted_triton_below_native_backends(case, caplog):
    _, backend, selected, words = case
    with caplog.at_level(logging.INFO, logger="moelora.oracle"):
        selection = select(deploy("tiny", "cpu", backend=backend), THREE)
    line = caplog.records[-1].getMessage()
    assert selection.name == selected, line
    assert selection.interpreted == (selected == "triton")
    assert all(w in line for w in words), line


def test_a_gpu_keeps_the_registry_order():
    # On a GPU nothing runs interpreted: triton (registry order before reference) wins.
    selection = select(deploy("tiny", "h200"), {"triton": TRITON_LIKE, **THREE})
    assert selection.name == "triton" and not selection.interpreted


def test_auto_refusal_lists_every_backend_and_no_acceptor():
    dep = deploy("nemotron-h", "h200", cuda_graphs=True)  # reference is not graph-safe
    registry = {"mimic": MIMIC, "reference": REGISTRY["reference"]}
    with pytest.raises(UnsupportedDeploymentError) as err:
        select(dep, registry)
    assert set(err.value.reasons) == {"mimic", "reference"}
    assert err.value.accepting == []
    assert "cuda_graphs = True: needs eager execution (--enforce-eager)" in str(err.value)


def test_explicit_refusal_names_the_fix_and_the_acceptors():
    with pytest.raises(UnsupportedDeploymentError) as err:
        select(deploy("tiny", "h200", backend="mimic"), THREE)
    message = str(err.value)
    assert "moe backend 'mimic' cannot run this deployment" in message
    assert "would accept it: triton, reference" in message
    assert "Fix: use --moe-backend triton" in message


def test_lora_only_backend_is_refused_without_expert_lora():
    dep = deploy("tiny", backend="lora_only", lora=True, targets=("o_proj",))
    with pytest.raises(UnsupportedDeploymentError, match=re.escape("lora.on_experts = False")):
        select(dep, {"lora_only": LORA_ONLY})


# Deployment: derived facts and configuration errors.
@pytest.mark.parametrize(
    "knobs, i_p, e_l, mode, sharding",
    [
        (dict(), 768, 128, ParallelMode.SINGLE, LoRASharding.UNSHARDED),
        (dict(tp=4), 192, 128, ParallelMode.TP, LoRASharding.TP),
        (dict(tp=4, fully_sharded=True), 192, 128, ParallelMode.TP, LoRASharding.FULLY_SHARDED),
        (dict(ep=8), 768, 16, ParallelMode.EP, LoRASharding.UNSHARDED),
        (dict(tp=2, ep=4), 384, 32, ParallelMode.TP_EP, LoRASharding.TP),
    ],
)
def test_deployment_derived_facts(knobs, i_p, e_l, mode, sharding):
    dep = deploy("qwen3-30b-a3b", lora=True, **knobs)
    assert dep.intermediate_per_partition == i_p
    assert dep.local_experts == dep.num_groups == e_l
    assert (dep.parallel_mode, dep.lora_sharding) == (mode, sharding)


@pytest.mark.parametrize(
    "knobs, key",
    [
        (dict(tp=5), "tensor_parallel_size"),  # 768 % 5
        (dict(ep=3), "expert_parallel_size"),  # 128 % 3
        (dict(tp=4, lora=True, fully_sharded=True, rank=6), "max_rank"),  # A split on R
        (dict(device="cpu", cuda_graphs=True), "cuda_graphs"),
        (dict(backend=""), "moe_backend"),
        (dict(dtype="int8"), "dtype"),
    ],
)
def test_deployment_config_errors_name_the_key(knobs, key):
    with pytest.raises(ConfigError) as err:
        deploy("qwen3-30b-a3b", **knobs)
    assert err.value.key == key


def test_dtype_auto_keeps_the_models_and_an_explicit_one_replaces_it():
    assert deploy("tiny").dtype == torch.float32
    assert deploy("tiny", dtype="bf16").dtype == torch.bfloat16


# Devices.
@pytest.mark.parametrize(
    "name, kind, cc",
    [("h200", "cuda", (9, 0)), ("H100", "cuda", (9, 0)), ("sm90", "cuda", (9, 0)),
     ("b200", "cuda", (10, 0)), ("sm100", "cuda", (10, 0)), ("b300", "cuda", (10, 3)),
     ("sm103", "cuda", (10, 3)), ("cpu", "cpu", None)],
)  # fmt: skip
def test_named_targets(name, kind, cc):
    facts = device_mod.resolve_device(name)
    assert (facts.kind, facts.compute_capability) == (kind, cc)
    assert {"torch", "triton"} <= facts.packages


def test_unknown_target_is_a_config_error():
    with pytest.raises(ConfigError, match="h200"):
        device_mod.resolve_device("tpu-v5")


def test_probe_reports_this_machine(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    facts = device_mod.resolve_device("local")
    assert "torch" in facts.packages
    if facts.kind == "cpu":
        assert facts.interpreted and facts.compute_capability is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert device_mod.probe().interpreted is False or facts.kind == "cuda"


# Registry.
def test_registry_follows_the_ranking_and_holds_backends():
    assert list(REGISTRY) == [name for name in RANKING if name in REGISTRY]
    assert "reference" in REGISTRY
    for name, backend in REGISTRY.items():
        assert isinstance(backend, Backend) and backend.name == name


# Only the oracle chooses: no other module reads the registry. validate.py and bench.py are
# harnesses that run the backends named on their command line against the reference (they
# choose nothing for serving); any new reader must go through moelora.oracle.select.
def test_only_the_oracle_reads_the_registry():
    root = Path(moelora.__file__).parent
    readers = {
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if re.search(r"backends\.registry|from \.registry|REGISTRY", path.read_text())
    }
    # validate and bench resolve their backends through oracle.select() with the name.
    assert readers <= {"oracle.py", "backends/registry.py"}


# The reference backend: exactly moe_lora_reference, and the out / add_inputs contract.
@pytest.fixture
def case(seed):
    shape = MoEShape(4, 2, 16, 8, moelora.Activation.SILU, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 16, generator=gen)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [0, 2]], dtype=torch.int32)
    weights = torch.rand(5, 2, generator=gen)
    slots = torch.tensor([0, -1, 1, 0, -1], dtype=torch.int32)  # slot -1 rows included
    experts = random_expert_weights(shape, generator=gen)
    lora = random_lora_bank(shape, 2, 4, ranks=[4, 2], generator=gen)
    return (x, ids, weights, slots, experts, lora, shape)


def test_reference_backend_is_the_reference(case):
    ref = moe_lora_reference(*case)
    x, ids, w, slots, experts, bank, shape = case
    out = REGISTRY["reference"].forward(MoECall(x, ids, w, slots, bank), experts, shape)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("add_inputs", list(AddInputs))
def test_reference_backend_out_contract(case, add_inputs):
    ref = moe_lora_reference(*case)
    # ADD: a random prior; OVERWRITE: NaN poison, so an unwritten element fails
    start = torch.randn_like(ref) if add_inputs is AddInputs.ADD else poison_(torch.empty_like(ref))
    buffer = start.clone()
    x, ids, w, slots, experts, bank, shape = case
    call = MoECall(x, ids, w, slots, bank, out=buffer, add_inputs=add_inputs)
    out = REGISTRY["reference"].forward(call, experts, shape)
    assert out is buffer
    expected = start + ref if add_inputs is AddInputs.ADD else ref
    assert_close(out, expected, torch.float32, what=add_inputs.value)


def test_stub_records_are_valid_and_distinct():
    assert MIMIC.capabilities != TRITON_LIKE.capabilities
    with pytest.raises(ValueError, match="intermediate_align"):
        dataclasses.replace(MIMIC.capabilities, intermediate_align=0)
