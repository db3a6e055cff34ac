"""from_hf on the configs the installed transformers writes: every family's own config class,
several layer patterns each, read back from `to_dict()` and from `save_pretrained`'s
config.json. The truth is the model transformers builds from that config (which layers hold
routed experts, and their weight shapes), not a hand-written preset.

Why: transformers 5.24's NemotronHConfig derives num_hidden_layers from layers_block_type and
no longer saves it; a parser reading only what older configs stored refused such files.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers

from moelora import ModelConfig, from_hf
from moelora.hf import expert_weights_from_hf, toy

pytestmark = pytest.mark.filterwarnings("ignore")

MLA = dict(toy.MLA, n_shared_experts=1, intermediate_size=40)
QWEN = dict(moe_intermediate_size=12, num_experts=6, num_experts_per_tok=2, intermediate_size=40)
QWEN35 = dict(moe_intermediate_size=12, num_experts=6, num_experts_per_tok=2,
              shared_expert_intermediate_size=24)  # fmt: skip
DSV2 = dict(moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=3, **MLA)
DSV3 = dict(DSV2, n_group=2, topk_group=1)
NEMO = dict(moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, mlp_hidden_act="relu2", moe_shared_expert_intermediate_size=24,
            intermediate_size=40, ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=8,
            n_groups=1)  # fmt: skip
LLAMA4 = dict(intermediate_size=12, intermediate_size_mlp=40, num_local_experts=4,
              num_experts_per_tok=1)  # fmt: skip
GPT_OSS = dict(intermediate_size=12, num_local_experts=6, num_experts_per_tok=2)

# (id, model_type, config kwargs, wrapper model_type or None) -- the comment says which
# layer pattern (or saved-config quirk) the case covers.
CASES = [
    # Qwen3-MoE: to_dict() renames num_experts to num_local_experts
    ("qwen3-all-moe", "qwen3_moe", dict(QWEN, num_hidden_layers=3), None),
    ("qwen3-sparse-step-2", "qwen3_moe", dict(QWEN, num_hidden_layers=4, decoder_sparse_step=2), None),
    ("qwen3-mlp-only", "qwen3_moe", dict(QWEN, num_hidden_layers=4, mlp_only_layers=[0, 2]), None),
    ("qwen3-step-and-mlp-only", "qwen3_moe",
     dict(QWEN, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]), None),
    # Qwen3.5-MoE: layer_types are attention kinds; every layer is MoE
    ("qwen3.5-text-hybrid", "qwen3_5_moe_text",
     dict(QWEN35, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2), None),
    ("qwen3.5-text-full", "qwen3_5_moe_text",
     dict(QWEN35, num_hidden_layers=2, layer_types=["full_attention"] * 2), None),
    ("qwen3.5-wrapper", "qwen3_5_moe_text",  # the multimodal config nests text_config
     dict(QWEN35, num_hidden_layers=3, layer_types=["linear_attention"] * 2 + ["full_attention"]),
     "qwen3_5_moe"),
    ("mixtral-1-layer", "mixtral", dict(GPT_OSS, num_hidden_layers=1), None),
    ("mixtral-3-layers", "mixtral", dict(GPT_OSS, num_hidden_layers=3), None),
    ("olmoe-renorm", "olmoe", dict(GPT_OSS, num_experts=6, num_hidden_layers=2,
                                   norm_topk_prob=True), None),
    ("olmoe-3-layers", "olmoe", dict(GPT_OSS, num_experts=6, num_hidden_layers=3), None),
    # DeepSeek: the first k layers dense
    ("dsv2-no-dense", "deepseek_v2", dict(DSV2, num_hidden_layers=2, first_k_dense_replace=0), None),
    ("dsv2-first-1-dense", "deepseek_v2",
     dict(DSV2, num_hidden_layers=3, first_k_dense_replace=1, topk_method="group_limited_greedy",
          n_group=2, topk_group=2), None),
    ("dsv3-first-2-dense", "deepseek_v3", dict(DSV3, num_hidden_layers=3, first_k_dense_replace=2), None),
    ("dsv3-all-dense", "deepseek_v3", dict(DSV3, num_hidden_layers=2, first_k_dense_replace=2), None),
    # gpt-oss: layer_types are attention kinds; every layer is MoE
    ("gpt-oss-sliding-full", "gpt_oss",
     dict(GPT_OSS, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]), None),
    ("gpt-oss-3-layers", "gpt_oss", dict(GPT_OSS, num_hidden_layers=3,
                                         layer_types=["full_attention"] * 3), None),
    # NemotronH: num_hidden_layers is a property and is not saved (the 5.24 regression)
    ("nemotron-list-3", "nemotron_h",
     dict(NEMO, layers_block_type=["moe", "full_attention", "moe"]), None),
    ("nemotron-mamba-list", "nemotron_h",
     dict(NEMO, layers_block_type=["linear_attention", "moe", "mlp", "moe", "full_attention"]), None),
    ("nemotron-legacy-pattern", "nemotron_h", dict(NEMO, hybrid_override_pattern="ME*E"), None),
    ("nemotron-latent", "nemotron_h",  # experts run in the latent space
     dict(NEMO, layers_block_type=["moe", "mlp"], moe_latent_size=16), None),
    # Llama-4: interleaved or listed MoE layers
    ("llama4-every-layer", "llama4_text", dict(LLAMA4, num_hidden_layers=2), None),
    ("llama4-step-2", "llama4_text", dict(LLAMA4, num_hidden_layers=4, interleave_moe_layer_step=2), None),
    ("llama4-listed", "llama4_text", dict(LLAMA4, num_hidden_layers=3, moe_layers=[0, 2]), None),
    ("llama4-wrapper", "llama4_text", dict(LLAMA4, num_hidden_layers=2, interleave_moe_layer_step=2),
     "llama4"),
]  # fmt: skip


def _configs(model_type: str, kw: dict, wrapper: str | None):
    """(config to save, the text config transformers builds the language model from)."""
    text = transformers.AutoConfig.for_model(
        model_type, **toy.COMMON, **kw
    )  # the layer count is each case's own
    if wrapper is None:
        return text, text
    return transformers.AutoConfig.for_model(wrapper, text_config=text.to_dict()), text


def _truth(text_config) -> tuple[int, list[int], torch.nn.Module | None]:
    """(layer count, layers holding routed experts, the first such experts module) of the
    model transformers builds from the config."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(text_config)
    layers = next(m for n, m in model.named_modules() if n.endswith("layers"))
    experts = {
        i: m
        for i, layer in enumerate(layers)
        for n, m in layer.named_modules()
        if n.split(".")[-1] == "experts"  # not shared_experts / shared_expert
    }
    return len(layers), sorted(experts), next(iter(experts.values()), None)


def _check(parsed: ModelConfig, text_config, truth) -> None:
    num_layers, moe_layers, experts = truth
    assert parsed.num_layers == num_layers
    assert list(parsed.moe_layers) == moe_layers
    assert parsed.shape.top_k == text_config.num_experts_per_tok
    if experts is not None:  # raises ConfigError unless E, S*I, H and I all match
        expert_weights_from_hf(experts, parsed)


@pytest.mark.parametrize("model_type,kw,wrapper", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_from_hf_reads_what_transformers_saves(tmp_path, model_type, kw, wrapper) -> None:
    saved, text = _configs(model_type, kw, wrapper)
    saved.save_pretrained(tmp_path)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    truth = _truth(text)
    from_dict = from_hf(saved.to_dict())
    from_file = from_hf(tmp_path / "config.json")
    _check(from_dict, text, truth)
    _check(from_file, text, truth)
    assert (from_file.shape, from_file.routing) == (from_dict.shape, from_dict.routing)
    if model_type == "nemotron_h":  # the quirk this table exists for
        assert "num_hidden_layers" not in on_disk


def test_table_covers_every_family() -> None:
    from moelora.hf_keys import FAMILIES, WRAPPERS

    covered = {c[1] for c in CASES} | {c[3] for c in CASES if c[3]}
    assert covered == set(FAMILIES) | set(WRAPPERS)
    for family in FAMILIES:  # several layer patterns each
        assert sum(c[1] == family for c in CASES) >= 2, family
