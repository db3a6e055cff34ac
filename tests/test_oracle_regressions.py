"""The field failures of SPEC.md "Why it exists", replayed against a test-only backend that
mimics the vendor kernel (MIMIC: cc 10.x, gated silu, I_p % 128 == 0, LoRA with
add_inputs OVERWRITE only, so never fully sharded). MIMIC is ranked first (fastest)."""

from __future__ import annotations

import pytest
from oracle_doubles import ATTENTION_ONLY, LORA_ONLY, MIMIC, TRITON_LIKE, deploy, fields

from moelora.backends.base import check
from moelora.backends.registry import REGISTRY
from moelora.config import AddInputs
from moelora.errors import UnsupportedDeploymentError
from moelora.oracle import select

# "triton" here is TRITON_LIKE, the record SPEC.md asks of it (every sharding mode), so the
# oracle's behaviour is tested independently of the real backend's current record.
WITH_MIMIC = {"mimic": MIMIC, "triton": TRITON_LIKE, "reference": REGISTRY["reference"]}


def test_mimic_is_reachable_when_it_fits():
    # Guards the tests below against being vacuous: on sm100 a gated-silu bf16 model with
    # I_p % 128 == 0 and no expert LoRA does select the mimic under auto.
    assert select(deploy("qwen3-30b-a3b", "b200"), WITH_MIMIC).name == "mimic"


# Failure 1: a non-gated relu2 MoE (NemotronH) reached a gated-only kernel and crashed.
@pytest.mark.parametrize("device", ["b200", "b300", "sm100", "sm103"])
@pytest.mark.parametrize("tp", [1, 2, 4])  # I = 1856: I_p = 1856, 928, 464
@pytest.mark.parametrize("lora", [False, True])
def test_non_gated_relu2_never_reaches_mimic(device, tp, lora):
    dep = deploy("nemotron-h", device, tp=tp, lora=lora, add_inputs=AddInputs.OVERWRITE)
    assert select(dep, WITH_MIMIC).name != "mimic"
    with pytest.raises(UnsupportedDeploymentError) as err:
        select(deploy("nemotron-h", device, tp=tp, backend="mimic"), WITH_MIMIC)
    assert {"activation", "gating"} <= fields(err.value.reasons["mimic"])
    assert "gating = non_gated" in str(err.value)


# Failure 2: `--moe-backend triton` with LoRA was replaced by the faster vendor kernel, which
# then asserted on fully sharded LoRA. An explicit choice must be honoured.
@pytest.mark.parametrize("add_inputs", list(AddInputs))
@pytest.mark.parametrize("device", ["sm103", "b300"])
def test_explicit_triton_with_fully_sharded_lora_on_sm103_is_honoured(device, add_inputs):
    # qwen3.5-35b-a3b: I = 512, tp 2 -> I_p = 256, a multiple of 128: only LoRA sharding
    # keeps the mimic out.
    knobs = dict(tp=2, lora=True, fully_sharded=True, add_inputs=add_inputs)
    chosen = select(deploy("qwen3.5-35b-a3b", device, backend="triton", **knobs), WITH_MIMIC)
    assert (chosen.name, chosen.how) == ("triton", "explicit")
    auto = select(deploy("qwen3.5-35b-a3b", device, **knobs), WITH_MIMIC)
    assert auto.name == "triton"
    assert "lora.sharding" in fields(dict(auto.others)["mimic"])  # the sharding, not the mode


@pytest.mark.parametrize("fully_sharded", [False, True])
def test_real_triton_explicit_request_is_honoured_or_refused_never_substituted(fully_sharded):
    # The real record, whatever it declares: an explicit request either runs triton or fails
    # naming triton's own reasons; it never turns into the mimic.
    registry = {"mimic": MIMIC, **REGISTRY}
    knobs = dict(tp=2, lora=True, fully_sharded=fully_sharded, backend="triton")
    dep = deploy("qwen3.5-35b-a3b", "sm103", **knobs)
    reasons = check(REGISTRY["triton"].capabilities, dep)
    if not reasons:
        assert select(dep, registry).name == "triton"
        return
    with pytest.raises(UnsupportedDeploymentError) as err:
        select(dep, registry)
    assert list(err.value.reasons) == ["triton"]
    assert err.value.reasons["triton"] == reasons


@pytest.mark.parametrize("add_inputs", list(AddInputs))
def test_real_triton_record_honours_fully_sharded_lora_and_grouped_mm_refuses_it(add_inputs):
    # Failure 2 against the real records: `--moe-backend triton --fully-sharded-loras` runs
    # triton (tests/test_parallel.py checks its result); grouped_mm still refuses it.
    knobs = dict(tp=2, lora=True, fully_sharded=True, add_inputs=add_inputs)
    dep = deploy("qwen3.5-35b-a3b", "sm103", backend="triton", **knobs)
    assert check(REGISTRY["triton"].capabilities, dep) == []
    assert select(dep, {"mimic": MIMIC, **REGISTRY}).name == "triton"
    gmm = check(REGISTRY["grouped_mm"].capabilities, deploy("qwen3.5-35b-a3b", "h200", **knobs))
    assert fields(gmm) == {"lora.sharding"}  # issue 18.3: the sharding is what fails


def test_explicit_triton_is_honoured_even_where_mimic_would_win_auto():
    knobs = dict(tp=2, lora=True, add_inputs=AddInputs.OVERWRITE)
    assert select(deploy("qwen3.5-35b-a3b", "sm103", **knobs), WITH_MIMIC).name == "mimic"
    explicit = deploy("qwen3.5-35b-a3b", "sm103", backend="triton", **knobs)
    assert select(explicit, WITH_MIMIC).name == "triton"


@pytest.mark.parametrize("add_inputs", list(AddInputs))
def test_explicit_mimic_with_fully_sharded_lora_is_refused_naming_the_sharding(add_inputs):
    dep = deploy(
        "qwen3.5-35b-a3b",
        "sm103",
        tp=2,
        lora=True,
        fully_sharded=True,
        add_inputs=add_inputs,
        backend="mimic",
    )
    with pytest.raises(UnsupportedDeploymentError) as err:
        select(dep, WITH_MIMIC)
    assert fields(err.value.reasons["mimic"]) == {"lora.sharding"}  # nothing else fails
    message = str(err.value)
    assert "lora.sharding = fully_sharded: needs one of unsharded, tp LoRA" in message
    assert err.value.accepting == ["triton", "reference"]


# The I_p % 128 rule: Qwen3-30B-A3B, I = 768, tp 4 -> I_p = 192.
@pytest.mark.parametrize("device", ["b200", "sm103"])
@pytest.mark.parametrize("lora", [False, True])
def test_qwen3_30b_at_tp4_never_reaches_mimic(device, lora):
    dep = deploy("qwen3-30b-a3b", device, tp=4, lora=lora, add_inputs=AddInputs.OVERWRITE)
    assert dep.intermediate_per_partition == 192
    chosen = select(dep, WITH_MIMIC)
    assert chosen.name != "mimic"
    reasons = dict(chosen.others)["mimic"]
    assert [(r.field, r.value) for r in reasons] == [("intermediate_per_partition", 192)]


@pytest.mark.parametrize(
    "tp, i_p, reaches",
    [
        (1, 768, True),  # 6 * 128
        (2, 384, True),  # 3 * 128
        (4, 192, False),  # the field failure
        (8, 96, False),
    ],
)
def test_qwen3_30b_mimic_alignment_by_tp(tp, i_p, reaches):
    dep = deploy("qwen3-30b-a3b", "b200", tp=tp)
    assert dep.intermediate_per_partition == i_p
    assert (select(dep, WITH_MIMIC).name == "mimic") is reaches


# Failure 3: LoRA on attention only still made the MoE layer pick a LoRA-only kernel.
WITH_LORA_ONLY = {"lora_only": LORA_ONLY, **WITH_MIMIC}


def test_attention_only_lora_does_not_force_a_lora_backend():
    dep = deploy("qwen3.5-35b-a3b", "b200", tp=2, lora=True, targets=ATTENTION_ONLY)
    assert not dep.lora_on_experts
    chosen = select(dep, WITH_LORA_ONLY)
    assert chosen.name == "mimic"  # the fastest plain kernel
    assert fields(dict(chosen.others)["lora_only"]) == {"lora.on_experts"}


def test_attention_only_lora_carries_no_lora_requirement_even_fully_sharded():
    # Fully sharded LoRA on attention puts nothing on the experts: the mimic, which cannot
    # do fully sharded LoRA, still runs the experts.
    dep = deploy(
        "qwen3.5-35b-a3b", "b200", tp=2, lora=True, fully_sharded=True, targets=ATTENTION_ONLY
    )
    assert select(dep, WITH_MIMIC).name == "mimic"


def test_expert_lora_does_select_the_lora_only_kernel():
    dep = deploy("qwen3.5-35b-a3b", "b200", tp=2, lora=True)
    assert select(dep, WITH_LORA_ONLY).name == "lora_only"
