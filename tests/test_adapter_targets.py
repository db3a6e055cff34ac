"""No silent no-op adapters (moelora/lora/targets.py): an adapter whose config targets the
experts but whose file holds none is refused; one with no expert LoRA is refused unless the
caller serves the other modules (serves_non_expert); one whose served delta is all zeros
loads with exactly one warning. Files are written from known tensors; nothing is mocked."""

from __future__ import annotations

import logging

import adapter_files as af
import pytest
import torch

from moelora.errors import AdapterError
from moelora.lora import SlotManager, load_adapter

MC = af.model_config("qwen3_moe")
R, RANK = 8, 2
ATTN = "base_model.model.model.layers.{n}.self_attn.q_proj"
SHARED = "base_model.model.model.layers.{n}.mlp.shared_experts.{p}"
ZERO_WARNING = "every LoRA delta it serves is zero"


def _module(key: str, zero_b: bool = False, zero_a: bool = False) -> dict[str, torch.Tensor]:
    """One Linear LoRA module (A [r, 32], B [32, r]), random unless told zero."""
    a = torch.zeros(RANK, 32) if zero_a else torch.randn(RANK, 32)
    b = torch.zeros(32, RANK) if zero_b else torch.randn(32, RANK)
    return {f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b}


def attention(zero_b: bool = False) -> dict[str, torch.Tensor]:
    return {k: v for n in MC.moe_layers for k, v in _module(ATTN.format(n=n), zero_b).items()}


def shared_experts() -> dict[str, torch.Tensor]:
    return {
        k: v
        for n in MC.moe_layers
        for p in ("up_proj", "down_proj")
        for k, v in _module(SHARED.format(n=n, p=p)).items()
    }


def experts(zero: str = "") -> dict[str, torch.Tensor]:
    """Per-expert factors; zero: '' none, 'B' every B, 'mixed' gate/up A and down B."""
    factors = af.known_factors(MC, RANK, seed=3)
    for (layer, part), (a, b) in factors.items():
        if zero == "B" or (zero == "mixed" and part == "down"):
            b = torch.zeros_like(b)
        if zero == "mixed" and part != "down":
            a = torch.zeros_like(a)
        factors[(layer, part)] = (a, b)
    return af.per_expert_tensors(factors)


def fused_zero_b() -> dict[str, torch.Tensor]:
    """What PEFT saves for target_parameters before training: B all zeros."""
    factors = af.known_factors(MC, RANK, seed=4)
    for layer in MC.moe_layers:
        factors[(layer, "up")] = (factors[(layer, "gate")][0], factors[(layer, "up")][1])
    return {
        k: torch.zeros_like(v) if "lora_B" in k else v
        for k, v in af.fused_tensors(MC, factors).items()
    }


FUSED_TARGETS = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}

# (id, tensors, adapter_config extras, serves_non_expert, regex of the refusal or None)
REFUSED = [
    # the deployment runs only the experts; q_proj alone changes nothing there
    ("attention-only", attention, {"target_modules": ["q_proj"]}, False, r"q_proj.*do not run"),
    # the config asked PEFT for the experts, the file has none: refused even when the
    # caller serves attention (the experts part would silently be missing)
    ("target-parameters-no-expert-tensors", attention, FUSED_TARGETS, True,
     r"target_parameters.*mlp\.experts\.gate_up_proj.*no expert tensors"),
    # transformers 5 fused experts: a Linear name PEFT found nowhere
    ("down-proj-matched-nothing", attention, {"target_modules": ["q_proj", "down_proj"]}, True,
     r"target_modules.*\['down_proj'\].*no expert tensors"),
    ("regex-on-experts", attention, {"target_modules": r".*\.experts\..*_proj"}, True,
     r"experts.*no expert tensors"),
    # up/down matched the shared experts (NemotronH's case): not a missing target, but
    # nothing the expert layers run either
    ("shared-experts-only", shared_experts, {"target_modules": ["up_proj", "down_proj"]}, False,
     r"shared_experts.*do not run"),
]  # fmt: skip


@pytest.mark.parametrize(
    "tensors,extra,serves,pattern", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED]
)
def test_no_op_adapters_are_refused(tmp_path, tensors, extra, serves, pattern) -> None:
    path = af.write_adapter(tmp_path / "ad", tensors(), af.lora_config(RANK, RANK, **extra))
    with pytest.raises(AdapterError, match=pattern) as info:
        load_adapter(path, MC, R, serves_non_expert=serves)
    assert info.value.file.startswith(str(path)) and info.value.expected
    manager = SlotManager(MC, num_slots=1, max_rank=R, dtype=torch.float32)
    with pytest.raises(AdapterError, match=pattern):  # the slot manager refuses it the same way
        manager.load(path, serves_non_expert=serves)
    assert manager.loaded == {} and manager.snapshot().version == 0


# (id, tensors, adapter_config extras, serves_non_expert, layout, zero-delta warnings)
LOADED = [
    ("attention-served-elsewhere", attention, {"target_modules": ["q_proj"]}, True, "none", 0),
    ("shared-experts-served-elsewhere", shared_experts,
     {"target_modules": ["up_proj", "down_proj"]}, True, "none", 0),
    ("all-linear-names-no-module", attention, {"target_modules": "all-linear"}, True, "none", 0),
    ("untrained-attention", lambda: attention(zero_b=True), {"target_modules": ["q_proj"]}, True,
     "none", 1),
    ("trained-experts", experts, {}, False, "per_expert", 0),  # the control: no warning
    ("untrained-experts-B-zero", lambda: experts("B"), {}, False, "per_expert", 1),
    ("zero-A-or-B-per-part", lambda: experts("mixed"), {}, False, "per_expert", 1),
    ("untrained-fused", fused_zero_b, FUSED_TARGETS, False, "fused", 1),
    # experts untrained, attention trained: zero for the expert layers alone ...
    ("zero-experts-beside-attention", lambda: {**experts("B"), **attention()}, {}, False,
     "per_expert", 1),
    # ... but not for a caller that also serves the attention LoRA
    ("zero-experts-attention-served", lambda: {**experts("B"), **attention()}, {}, True,
     "per_expert", 0),
]  # fmt: skip


@pytest.mark.parametrize(
    "tensors,extra,serves,layout,warnings",
    [c[1:] for c in LOADED],
    ids=[c[0] for c in LOADED],
)
def test_adapters_that_change_something_load(
    tmp_path, caplog, tensors, extra, serves, layout, warnings
) -> None:
    path = af.write_adapter(tmp_path / "ad", tensors(), af.lora_config(RANK, RANK, **extra))
    with caplog.at_level(logging.WARNING, logger="moelora.lora"):
        adapter = load_adapter(path, MC, R, serves_non_expert=serves)
    assert adapter.layout == layout
    assert (adapter.layers == {}) == (layout == "none")
    zero = [r for r in caplog.records if ZERO_WARNING in r.getMessage()]
    assert len(zero) == warnings, [r.getMessage() for r in caplog.records]
    if zero:
        assert str(path) in zero[0].getMessage() and "initialisation" in zero[0].getMessage()
