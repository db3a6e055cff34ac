"""Small random transformers MoE models and PEFT adapters, built offline from configs: what
`moelora generate` runs when given no model, and what the tests compare against.

Every weight is random and non-zero (std 1/sqrt(fan_in)); every LoRA factor too (PEFT starts
B at zero, which would make an adapter a no-op). Adapters are written by PEFT's own
`save_pretrained`, in the layouts PEFT produces for fused experts.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

# The config keys every tiny family shares (the tests build their one-block models from them
# too), and DeepSeek's multi-head latent attention at the same tiny size.
COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
    tie_word_embeddings=False,
)
MLA = dict(q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)

# model_type -> config kwargs of a tiny model with two MoE layers. I = 12, H = 32: the fused
# factors of PEFT files read unambiguously (H != I, H != 2I).
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        num_hidden_layers=2, moe_intermediate_size=12, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True, intermediate_size=40,
    ),
    "qwen3_5_moe_text": dict(
        num_hidden_layers=2, moe_intermediate_size=12, num_experts=6, num_experts_per_tok=2,
        shared_expert_intermediate_size=24, layer_types=["full_attention"] * 2,
    ),
    "mixtral": dict(
        num_hidden_layers=2, intermediate_size=12, num_local_experts=6, num_experts_per_tok=2
    ),
    "olmoe": dict(
        num_hidden_layers=2, intermediate_size=12, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=False,
    ),
    "deepseek_v3": dict(
        num_hidden_layers=3, moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        n_shared_experts=1, first_k_dense_replace=1, intermediate_size=40, head_dim=4, num_key_value_heads=4, **MLA,
    ),
    "deepseek_v2": dict(
        num_hidden_layers=3, moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=2.5,
        n_shared_experts=1, first_k_dense_replace=1, intermediate_size=40, num_key_value_heads=4,
        **MLA,
    ),
    "gpt_oss": dict(
        num_hidden_layers=2, intermediate_size=12, num_local_experts=6, num_experts_per_tok=2,
        layer_types=["full_attention"] * 2,
    ),
    # attention first: transformers 5.25's DynamicCache.get_seq_length() reads layer 0, which
    # fails on a first layer without a cache (a DummyLayer: "E*E" breaks HF's own generate)
    "nemotron_h": dict(
        moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, mlp_hidden_act="relu2",
        hybrid_override_pattern="*EE", moe_shared_expert_intermediate_size=24,
        intermediate_size=40, num_hidden_layers=3,
    ),
    "llama4_text": dict(
        num_hidden_layers=2, intermediate_size=12, intermediate_size_mlp=40,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1,
    ),
}  # fmt: skip


def build_model(
    model_type: str = "qwen3_moe",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    **overrides: Any,
) -> nn.Module:
    """A random AutoModelForCausalLM of the family (eval mode), from a config alone."""
    import transformers

    if model_type not in FAMILIES:
        raise KeyError(f"{model_type!r}: not one of {sorted(FAMILIES)}")
    kwargs = {**COMMON, **FAMILIES[model_type], **overrides}
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) / max(p.shape[-1], 1) ** 0.5)
        for name, b in model.named_buffers():  # e.g. DeepSeek's router correction bias
            if b.is_floating_point() and "correction_bias" in name:
                b.copy_(torch.randn_like(b) * 0.1)
    return model.to(device=device, dtype=dtype).eval()


def expert_parameters(model: nn.Module) -> list[str]:
    """PEFT target_parameters for the routed experts: e.g. ["mlp.experts.gate_up_proj",
    "mlp.experts.down_proj"] (NemotronH: mixer.experts.up_proj)."""
    for name, module in model.named_modules():
        down = getattr(module, "down_proj", None)
        if name.endswith("experts") and isinstance(down, torch.Tensor) and down.dim() == 3:
            path = name.split(".layers.", 1)[1].split(".", 1)[1]  # after "layers.N."
            first = "gate_up_proj" if hasattr(module, "gate_up_proj") else "up_proj"
            return [f"{path}.{first}", f"{path}.down_proj"]
    raise ValueError(f"{type(model).__name__}: no fused routed-experts module")


def write_peft_adapter(
    model: nn.Module, path: Path, *, seed: int, scale: float = 0.3, **lora_kwargs: Any
):
    """Wrap a copy of `model` with PEFT (peft.LoraConfig(**lora_kwargs)), give every LoRA
    factor random values, save it with PEFT's save_pretrained; returns the PEFT model."""
    import peft

    lora_kwargs.setdefault("target_modules", [])
    with warnings.catch_warnings():  # PEFT notes pattern keys its own rewrite made unused
        warnings.simplefilter("ignore", RuntimeWarning)
        peft_model = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(**lora_kwargs))
    peft_model.eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                noise = torch.randn(p.shape, generator=gen) * scale
                p.copy_(noise.to(device=p.device, dtype=p.dtype))
    peft_model.save_pretrained(str(path))
    return peft_model


# Per-module names PEFT accepts for the experts of a family (rewritten to target_parameters
# on fused experts). NemotronH's up/down name its shared experts; gpt-oss has none.
_MODULE_NAMES = {
    "mixtral": ["w1", "w2", "w3"],
    "nemotron_h": ["up_proj", "down_proj"],
    "gpt_oss": [],
}


def demo_adapters(model: nn.Module) -> dict[str, dict[str, Any]]:
    """The four adapters of the demo: two PEFT layouts (target_parameters on the fused
    experts; target_modules names that PEFT rewrites to target_parameters with the gate_up
    rank doubled), ranks 1 to 8, one with attention LoRA (q_proj, v_proj)."""
    fused = expert_parameters(model)
    names = _MODULE_NAMES.get(model.config.model_type, ["gate_proj", "up_proj", "down_proj"])
    modules = (
        dict(r=4, lora_alpha=4, use_rslora=True, target_modules=names)
        if names
        else dict(r=4, lora_alpha=4, use_rslora=True, target_parameters=fused[:1])
    )
    return {
        "fused-r8": dict(r=8, lora_alpha=16, target_parameters=fused),
        "fused-r4-attn": dict(
            r=4, lora_alpha=8, target_parameters=fused, target_modules=["q_proj", "v_proj"]
        ),
        "modules-r4": modules,
        "fused-r2": dict(r=2, lora_alpha=2, target_parameters=fused, rank_pattern={"down_proj": 1}),
    }
