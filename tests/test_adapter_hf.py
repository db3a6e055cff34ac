"""Outside truth: adapters made and saved by PEFT on tiny random transformers models, loaded
by moelora into slots; a batch mixing every adapter and slot -1 through moelora's reference
equals, row by row, the transformers experts module under PEFT with that row's adapter.

Sizes H = 32, I = 20 keep the fused factors readable from their shapes (H != 2I, H != I).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

import peft
import pytest
import torch
import transformers

from moelora import ExpertWeights, from_hf, moe_lora_reference
from moelora.compare import assert_close
from moelora.errors import AdapterError
from moelora.lora import SlotManager, load_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

H, INTER, E, K, LAYERS, R = 32, 20, 4, 2, 2, 8
COMMON = dict(
    hidden_size=H,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=64,
    num_experts_per_tok=K,
)
FAMILIES = {
    "qwen3_moe": dict(num_experts=E, moe_intermediate_size=INTER, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=E, intermediate_size=INTER),
}
FUSED = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# name -> LoraConfig kwargs; each covers one edge of the config -> scale mapping.
ADAPTERS = {
    # plain alpha / r, plus an attention module that must be reported, not served
    "fused_r4": dict(r=4, lora_alpha=8, target_parameters=FUSED, target_modules=["q_proj"]),
    # rsLoRA alpha / sqrt(r); per-module names rewritten by PEFT to target_parameters with
    # the gate_up rank doubled through rank_pattern / alpha_pattern
    "modules_rs": dict(r=2, lora_alpha=3, use_rslora=True, target_modules="MODULES"),
    # rank_pattern / alpha_pattern on one fused parameter: down rank 2, gate_up rank 5
    "patterned": dict(
        r=5,
        lora_alpha=4,
        target_parameters=FUSED,
        rank_pattern={"down_proj": 2},
        alpha_pattern={"down_proj": 7},
    ),
}


MODULES = {"qwen3_moe": ["gate_proj", "up_proj", "down_proj"], "mixtral": ["w1", "w2", "w3"]}


@dataclass
class Family:
    model_type: str
    base: torch.nn.Module
    peft_models: dict[str, torch.nn.Module]
    dirs: dict[str, Path]


def _build(model_type: str, root: Path) -> Family:
    torch.manual_seed(1234)
    cfg = transformers.AutoConfig.for_model(model_type, **COMMON, **FAMILIES[model_type])
    base = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    models, dirs = {}, {}
    for name, kw in ADAPTERS.items():
        kw = dict(kw)
        if kw.get("target_modules") == "MODULES":
            kw["target_modules"] = MODULES[model_type]
        pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**kw)).eval()
        with torch.no_grad():  # PEFT starts B at zero: make every factor random and non-zero
            for pname, p in pm.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn_like(p) * 0.3)
        dirs[name] = root / f"{model_type}_{name}"
        pm.save_pretrained(dirs[name])
        models[name] = pm
    return Family(model_type, base, models, dirs)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    return _build(request.param, tmp_path_factory.mktemp(request.param))


def _model_config(fam: Family):
    return from_hf(fam.base.config.to_dict())


def _layer(model: torch.nn.Module, layer: int) -> torch.nn.Module:
    inner = model.base_model.model if isinstance(model, peft.PeftModel) else model
    return inner.model.layers[layer].mlp


def test_mixed_batch_matches_transformers_with_peft(family: Family) -> None:
    """Every adapter and slot -1 in one batch; each row equals HF + PEFT with its adapter."""
    mc = _model_config(family)
    manager = SlotManager(mc, num_slots=4, max_rank=R, dtype=torch.float32)
    for name, path in family.dirs.items():
        manager.load(path, name=name)
    names = [None, *ADAPTERS] * 4  # 16 tokens, every adapter and the base model 4 times
    torch.manual_seed(7)
    for layer in mc.moe_layers:
        x = torch.randn(len(names), H)
        mlp = _layer(family.base, layer)
        _, topk_weights, topk_ids = mlp.gate(x)
        experts = ExpertWeights(
            mlp.experts.gate_up_proj.detach().clone(), mlp.experts.down_proj.detach().clone()
        )
        snap, slots = manager.token_slots(names)
        out = moe_lora_reference(
            x, topk_ids, topk_weights.float(), slots, experts, snap.banks[layer], mc.shape
        )
        with torch.no_grad():
            refs = {None: mlp.experts(x, topk_ids, topk_weights)}
            for name, pm in family.peft_models.items():
                refs[name] = _layer(pm, layer).experts(x, topk_ids, topk_weights)
        assert not torch.allclose(refs["fused_r4"], refs[None], atol=1e-3), "delta too small"
        for name, ref in refs.items():
            rows = [t for t, n in enumerate(names) if n == name]
            assert_close(out[rows], ref[rows], torch.float32, what=f"layer {layer} {name}")


def test_loaded_factors_reproduce_peft_merged_delta(family: Family) -> None:
    """B @ A from the loaded adapter equals PEFT's own delta weight for each fused param."""
    mc = _model_config(family)
    for name, pm in family.peft_models.items():
        adapter = load_adapter(family.dirs[name], mc, R)
        assert adapter.layout == "fused"  # PEFT rewrites per-module names on fused experts
        for layer in mc.moe_layers:
            wrapper = _layer(pm, layer).experts
            deltas = {}
            for mod in (wrapper, wrapper.base_layer):
                deltas[mod.parameter_name] = mod.get_delta_weight("default").detach()
            lora = adapter.layers[layer]
            gate = torch.einsum("eir,erh->eih", lora.w13_b[:, 0], lora.w13_a[:, 0])
            up = torch.einsum("eir,erh->eih", lora.w13_b[:, 1], lora.w13_a[:, 1])
            down = torch.einsum("ehr,eri->ehi", lora.w2_b, lora.w2_a)
            assert_close(torch.cat([gate, up], 1), deltas["gate_up_proj"], torch.float32)
            assert_close(down, deltas["down_proj"], torch.float32)


def test_non_expert_modules_are_reported(family: Family) -> None:
    adapter = load_adapter(family.dirs["fused_r4"], _model_config(family), R)
    assert adapter.non_expert_modules
    assert all("self_attn.q_proj" in m for m in adapter.non_expert_modules)
    assert len(adapter.non_expert_modules) == LAYERS


def test_ranks_follow_patterns(family: Family) -> None:
    """modules_rs: gate_up rank doubled to 4 by PEFT; patterned: max(gate_up 5, down 2)."""
    mc = _model_config(family)
    assert load_adapter(family.dirs["modules_rs"], mc, R).rank == 4
    patterned = load_adapter(family.dirs["patterned"], mc, R)
    assert patterned.rank == 5
    assert patterned.layers[0].w2_a[:, 2:].abs().sum() == 0  # down rank 2, zero-padded to 5


def test_rank_above_max_is_refused(family: Family) -> None:
    with pytest.raises(AdapterError, match="rank 5"):
        load_adapter(family.dirs["patterned"], _model_config(family), 4)


# (id, LoraConfig kwargs, serves_non_expert, expected: a refusal regex or "zero-warning")
# -- adapters as PEFT saves them without training (B starts at zero).
UNTRAINED = [
    ("experts-untrained", dict(r=2, target_parameters=FUSED), False, "zero-warning"),
    ("attention-for-experts-only", dict(r=2, target_modules=["q_proj"]), False, "do not run"),
    ("attention-served-elsewhere", dict(r=2, target_modules=["q_proj"]), True, "zero-warning"),
]


@pytest.mark.parametrize(
    "kw,serves,expected", [c[1:] for c in UNTRAINED], ids=[c[0] for c in UNTRAINED]
)
def test_untrained_and_attention_only_peft_adapters(
    family: Family, tmp_path, caplog, kw, serves, expected
) -> None:
    """PEFT's own files: an untrained adapter loads with one zero-delta warning; LoRA on
    attention alone is refused for the expert layers, loaded for a caller serving it."""
    pm = peft.get_peft_model(copy.deepcopy(family.base), peft.LoraConfig(**kw))
    pm.save_pretrained(tmp_path)
    mc = _model_config(family)
    if expected != "zero-warning":
        with pytest.raises(AdapterError, match=expected):
            load_adapter(tmp_path, mc, R, serves_non_expert=serves)
        return
    with caplog.at_level(logging.WARNING, logger="moelora.lora"):
        adapter = load_adapter(tmp_path, mc, R, serves_non_expert=serves)
    zero = [r for r in caplog.records if "is zero" in r.getMessage()]
    assert len(zero) == 1, [r.getMessage() for r in caplog.records]
    assert adapter.layout == ("fused" if "target_parameters" in kw else "none")
