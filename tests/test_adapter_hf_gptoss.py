"""Outside truth for gpt-oss: PEFT `target_parameters` adapters on its transposed, biased,
gate/up-interleaved experts, saved by PEFT, loaded by moelora; every row of a mixed batch
equals the transformers experts module under PEFT with that row's adapter (fp32)."""

from __future__ import annotations

import copy

import peft
import pytest
import torch
import transformers

from moelora import from_hf, moe_lora_reference, route
from moelora.compare import assert_close
from moelora.hf import expert_weights_from_hf, router_logits
from moelora.lora import SlotManager

H, INTER, E, K = 32, 20, 4, 2  # H != I and H != 2I: the fused factors read unambiguously
FUSED = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTERS = {"r4": dict(r=4, lora_alpha=8), "r2_rs": dict(r=2, lora_alpha=3, use_rslora=True)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(torch.seed() % 2**31)  # fresh weights each run
    cfg = transformers.AutoConfig.for_model(
        "gpt_oss", hidden_size=H, intermediate_size=INTER, num_local_experts=E,
        num_experts_per_tok=K, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=64, layer_types=["full_attention"],
    )  # fmt: skip
    base = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # experts start from torch.empty: give them real values
        for p in base.model.layers[0].mlp.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    root = tmp_path_factory.mktemp("gptoss")
    models = {}
    for name, kw in ADAPTERS.items():
        pm = peft.get_peft_model(
            copy.deepcopy(base), peft.LoraConfig(target_parameters=FUSED, target_modules=[], **kw)
        ).eval()
        with torch.no_grad():  # PEFT starts B at zero
            for pname, p in pm.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn_like(p) * 0.3)
        pm.save_pretrained(root / name)
        models[name] = pm
    return base, models, root


def test_gpt_oss_peft_adapters_match_row_by_row(setup):
    base, models, root = setup
    mc = from_hf(base.config.to_dict())
    manager = SlotManager(mc, num_slots=2, max_rank=8, dtype=torch.float32)
    for name in ADAPTERS:
        manager.load(root / name, name=name)
    names = [None, *ADAPTERS] * 4
    mlp = base.model.layers[0].mlp
    x = torch.randn(len(names), H)
    ids, weights = route(router_logits(mlp, x), mc.routing, K)
    experts = expert_weights_from_hf(mlp.experts, mc)
    snap, slots = manager.token_slots(names)
    out = moe_lora_reference(x, ids, weights, slots, experts, snap.banks[0], mc.shape)
    with torch.no_grad():
        refs = {None: mlp.experts(x, ids.long(), weights)}
        for name, pm in models.items():
            refs[name] = pm.base_model.model.model.layers[0].mlp.experts(x, ids.long(), weights)
    for name, ref in refs.items():
        rows = [t for t, n in enumerate(names) if n == name]
        if name is not None:  # the adapter visibly changes the output: the check can fail
            assert (ref[rows] - refs[None][rows]).abs().max() > 1e-2
        assert_close(out[rows], ref[rows], torch.float32, what=f"gpt-oss {name}")
