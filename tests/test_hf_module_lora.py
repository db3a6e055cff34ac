"""Every LoRA module an adapter carries served by moelora, per token: attention, shared
experts, dense MLP layers and the LM head (every nn.Linear of the model) beside the routed
experts. A mixed batch equals, row by row, HF + PEFT generating that row alone (tokens equal,
logits within the fp32 tolerance), in every family; PEFT is never injected into the model."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import alone, assert_equals_alone, mixed_batch
from torch import nn

from moelora.errors import AdapterError, ConfigError
from moelora.hf import attach, toy

pytestmark = pytest.mark.filterwarnings("ignore")
NEW_TOKENS = 4
# Row order: both module adapters, base rows between, an expert-only adapter, one repeated.
ROWS = ["all", None, "linear-only", "experts-only", "all", None]


def linear_paths(model: nn.Module) -> list[str]:
    """Every plain nn.Linear of the model (attention, shared experts, dense MLPs, LM head)."""
    return [n for n, m in model.named_modules() if type(m) is nn.Linear]


def peft_linears(peft_model: nn.Module) -> set[str]:
    """The nn.Linear paths PEFT put LoRA on (PEFT drops some target_modules on MoE models:
    DeepSeek's dense and shared MLP names become expert target_parameters)."""
    from peft.tuners.lora import LoraLayer

    return {
        n.removeprefix("base_model.model.")
        for n, m in peft_model.named_modules()
        if isinstance(m, LoraLayer) and type(m.get_base_layer()) is nn.Linear
    }


def router_paths(model: nn.Module) -> list[str]:
    """The routers PEFT puts LoRA on (a ParamWrapper on the weight), in the families where it
    can (checked with PEFT 0.21 / transformers 5: the others' routers are refused by PEFT or
    fail in its forward)."""
    if model.config.model_type not in ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3"):
        return []
    return [n for n, m in model.named_modules() if n.endswith(".mlp.gate")]


def module_adapters(model: nn.Module) -> dict[str, dict]:
    """PEFT configs: every Linear, the routers where PEFT writes them and the experts (ranks
    and scales per pattern), every Linear alone (rsLoRA), the experts alone."""
    linears, experts = linear_paths(model), toy.expert_parameters(model)
    return {
        "all": dict(
            r=4, lora_alpha=8, target_modules=linears + router_paths(model),
            target_parameters=experts,
            rank_pattern={"o_proj": 2, "lm_head": 3}, alpha_pattern={"lm_head": 1},
        ),
        "linear-only": dict(r=3, lora_alpha=6, use_rslora=True, target_modules=linears),
        "experts-only": dict(r=2, lora_alpha=4, target_parameters=experts),
    }  # fmt: skip


@pytest.fixture(scope="module", params=list(toy.FAMILIES))
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base = toy.build_model(request.param, seed=99)
    truths, dirs = {}, {}
    for i, (name, kw) in enumerate(module_adapters(base).items()):
        dirs[name] = root / name
        truths[name] = toy.write_peft_adapter(base, dirs[name], seed=500 + i, **kw)
    return request.param, base, truths, dirs


def test_every_linear_module_equals_peft_row_by_row(family, seed):
    model_type, base, truths, dirs = family
    orientation = {"fused_orientation": "natural"} if model_type == "nemotron_h" else {}
    model = copy.deepcopy(base)
    handle = attach(model, num_slots=3, max_rank=8, moe_backend="reference")
    for name, path in dirs.items():
        handle.load_adapter(path, name=name, **orientation)
    served = set(handle.describe("all")["modules"])
    want = peft_linears(truths["all"]) | set(router_paths(base))
    assert served == want, "every Linear and router PEFT adapted is served"
    assert "lm_head" in served and any(".self_attn." in p or ".mixer." in p for p in served)
    from peft.tuners.lora import ParamWrapper

    expert_lora = any(isinstance(m, ParamWrapper) for m in truths["linear-only"].modules())
    assert handle.describe("linear-only")["experts"] is expert_lora  # PEFT's rewrite decides
    gen = torch.Generator().manual_seed(seed)
    batch = mixed_batch(handle, ROWS, NEW_TOKENS, gen)
    for row, (name, (prompt, _, real)) in enumerate(zip(ROWS, batch)):
        truth = truths[name] if name else base
        assert_equals_alone(truth, batch[row], NEW_TOKENS, f"row {row} ({name})")
        if name == "linear-only":  # the modules alone change the logits
            assert not torch.allclose(real, alone(base, prompt, 0)[1], atol=1e-3)
    from peft.tuners.lora import LoraLayer

    assert not any(isinstance(m, LoraLayer) for m in model.modules()), "PEFT injected"
    # outside a handle call a served Linear is the base Linear, bit for bit
    h = torch.randn(3, model.lm_head.in_features, generator=gen)
    with torch.no_grad():
        assert torch.equal(model.lm_head(h), torch.nn.functional.linear(h, model.lm_head.weight))
    handle.detach()  # the hooks and the routers' served forwards are gone
    assert not any(m._forward_hooks for m in model.modules() if type(m) is nn.Linear)
    assert not any("forward" in vars(m) for m in model.modules())


def test_a_load_reads_the_weights_file_once(family, monkeypatch):
    """load_adapter parses the experts' and the modules' factors from one read of the file
    (a 48-layer adapter is 1.25 GB: reading it twice doubled the load's reads and its
    transient memory); a file that cannot be read is still refused, naming it."""
    from moelora.hf import handle as handle_module
    from moelora.lora import adapter as adapter_module
    from moelora.lora import safe_io

    model_type, base, _, dirs = family
    orientation = {"fused_orientation": "natural"} if model_type == "nemotron_h" else {}
    reads, real = [], safe_io.read_tensors
    for module in (handle_module, adapter_module):  # every caller of it, by its own name
        monkeypatch.setattr(module, "read_tensors", lambda root: reads.append(root) or real(root))
    handle = attach(copy.deepcopy(base), num_slots=2, max_rank=8, moe_backend="reference")
    handle.load_adapter(dirs["all"], name="all", **orientation)
    assert reads == [dirs["all"]] and set(handle.describe("all")["modules"])
    broken = dirs["all"].parent / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "adapter_config.json").write_text((dirs["all"] / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors"):
        handle.load_adapter(broken, name="broken", **orientation)
    assert handle.adapters == ["all"]


def test_target_modules_narrow_the_banks_and_refuse_the_rest(family):
    """lora_target_modules=["q_proj"]: only q_proj gets a bank; an adapter on more modules is
    refused naming one and the fix; a name matching no Linear is refused at attach."""
    model_type, base, _, dirs = family
    orientation = {"fused_orientation": "natural"} if model_type == "nemotron_h" else {}
    handle = attach(
        copy.deepcopy(base), num_slots=2, max_rank=8, moe_backend="reference",
        lora_target_modules=["q_proj"],
    )  # fmt: skip
    banks = handle.registry.manager.module_banks
    assert banks.shapes and all(p.endswith(".q_proj") for p in banks.shapes)
    with pytest.raises(AdapterError, match=r"does not serve.*lora_target_modules"):
        handle.load_adapter(dirs["linear-only"], name="x", **orientation)
    assert handle.adapters == [] and not handle.registry.manager.registered
    with pytest.raises(ConfigError, match="'nope_proj'"):
        attach(copy.deepcopy(base), num_slots=2, max_rank=4, lora_target_modules=["nope_proj"])
