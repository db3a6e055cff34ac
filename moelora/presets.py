"""Model presets, stored as plain Hugging Face config.json dicts and read through from_hf.

Only the MoE-relevant keys of each public config are kept. "tiny*" presets are small
random-weight cases for demos and tests.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from .config import ModelConfig, from_hf
from .errors import ConfigError

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "num_hidden_layers": 48,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "torch_dtype": "bfloat16",
    },
    "qwen3.5-35b-a3b": {
        "model_type": "qwen3_5_moe",
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "hidden_size": 2048,
            "moe_intermediate_size": 512,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "hidden_act": "silu",
            "num_hidden_layers": 40,
            "dtype": "bfloat16",
        },
    },
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "hidden_act": "silu",
        "num_hidden_layers": 32,
        "torch_dtype": "bfloat16",
    },
    "olmoe-1b-7b": {
        "model_type": "olmoe",
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "hidden_act": "silu",
        "num_hidden_layers": 16,
        "torch_dtype": "bfloat16",
    },
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2",
        "hidden_size": 2048,
        "moe_intermediate_size": 1408,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "hidden_act": "silu",
        "num_hidden_layers": 27,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "torch_dtype": "bfloat16",
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "torch_dtype": "bfloat16",
    },
    "gpt-oss-20b": {
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "swiglu_limit": 7.0,
        "num_hidden_layers": 24,
        "torch_dtype": "bfloat16",
    },
    # NemotronH style (Nemotron-3-Nano-30B-A3B sizes): non-gated relu2 experts.
    "nemotron-h": {
        "model_type": "nemotron_h",
        "hidden_size": 2688,
        "moe_intermediate_size": 1856,
        "n_routed_experts": 128,
        "num_experts_per_tok": 6,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "mlp_hidden_act": "relu2",
        "num_hidden_layers": 6,
        "hybrid_override_pattern": "MEM*EM",
        "torch_dtype": "bfloat16",
    },
    "llama4-scout": {
        "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text",
            "hidden_size": 5120,
            "intermediate_size": 8192,
            "num_local_experts": 16,
            "num_experts_per_tok": 1,
            "hidden_act": "silu",
            "num_hidden_layers": 48,
            "interleave_moe_layer_step": 1,
            "torch_dtype": "bfloat16",
        },
    },
    # Small random-weight cases: the demo's default and the tests' fixtures.
    "tiny": {
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "num_hidden_layers": 2,
        "torch_dtype": "float32",
    },
    "tiny-relu2": {
        "model_type": "nemotron_h",
        "hidden_size": 64,
        "moe_intermediate_size": 48,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "mlp_hidden_act": "relu2",
        "num_hidden_layers": 2,
        "hybrid_override_pattern": "ME",
        "torch_dtype": "float32",
    },
}


def preset_dict(name: str) -> dict[str, Any]:
    """A copy of the preset's config.json dict."""
    if name not in PRESETS:
        raise ConfigError(
            "model",
            name,
            f"a preset ({', '.join(PRESETS)}), a config.json path or a model directory",
            "`moelora presets` lists the presets with their shapes",
        )
    return copy.deepcopy(PRESETS[name])


def load_preset(name: str) -> ModelConfig:
    return from_hf(preset_dict(name), name=name)


def resolve_model(model: str) -> ModelConfig:
    """What --model accepts: a preset name, a path to a config.json, or a model directory
    holding one (as transformers' from_pretrained takes it) -> ModelConfig."""
    if model in PRESETS:
        return load_preset(model)
    path = Path(model)
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ConfigError(
                "model",
                model,
                "a model directory holding config.json",
                f"pass the directory that has config.json, or a config.json path ({config} "
                "does not exist)",
            )
        return from_hf(config)
    if model.endswith(".json") or "/" in model:
        return from_hf(model)
    return load_preset(model)  # raises naming the presets
