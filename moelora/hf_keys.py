"""The one table of Hugging Face config.json keys, per model family, and its parser.

Only `moelora.config.from_hf` calls `hf_fields`, and builds the ModelConfig from what it
returns (plain values: this module imports nothing of config.py, so no import circle);
everything else reads ModelConfig.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .activations import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, Activation
from .errors import ConfigError
from .routing import RoutingConfig, RoutingMethod

_MISSING = object()


@dataclass(frozen=True)
class Family:
    """Where one model family keeps its MoE facts in config.json."""

    experts_key: str  # E (aliases in EXPERT_KEY_ALIASES are accepted too)
    intermediate_key: str  # I
    routing: RoutingMethod
    gated: bool = True
    act_key: str = "hidden_act"
    renorm: str | bool = False  # a key name, or a fixed value
    has_bias: bool = False
    hidden_key: str = "hidden_size"
    layers: str = "all"  # how MoE layers are placed: all | qwen | deepseek | nemotron | llama4


FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family(
        "num_experts",
        "moe_intermediate_size",
        RoutingMethod.SOFTMAX_TOPK,
        renorm="norm_topk_prob",
        layers="qwen",
    ),
    "qwen3_5_moe_text": Family(
        "num_experts", "moe_intermediate_size", RoutingMethod.SOFTMAX_TOPK, renorm=True
    ),
    "mixtral": Family(
        "num_local_experts", "intermediate_size", RoutingMethod.SOFTMAX_TOPK, renorm=True
    ),
    "olmoe": Family(
        "num_experts", "intermediate_size", RoutingMethod.SOFTMAX_TOPK, renorm="norm_topk_prob"
    ),
    "deepseek_v2": Family(
        "n_routed_experts", "moe_intermediate_size", RoutingMethod.DEEPSEEK_V2, layers="deepseek"
    ),
    "deepseek_v3": Family(
        "n_routed_experts",
        "moe_intermediate_size",
        RoutingMethod.DEEPSEEK_V3,
        renorm="norm_topk_prob",
        layers="deepseek",
    ),
    "gpt_oss": Family(
        "num_local_experts", "intermediate_size", RoutingMethod.TOPK_SOFTMAX, has_bias=True
    ),
    "nemotron_h": Family(
        "n_routed_experts",
        "moe_intermediate_size",
        RoutingMethod.DEEPSEEK_V3,
        gated=False,
        act_key="mlp_hidden_act",
        renorm="norm_topk_prob",
        layers="nemotron",
    ),
    "llama4_text": Family(
        "num_local_experts", "intermediate_size", RoutingMethod.LLAMA4, layers="llama4"
    ),
}
# transformers 5 re-serialises some configs under another name for E (e.g. Qwen3-MoE's
# num_experts comes back as num_local_experts from to_dict()); any of these is accepted.
EXPERT_KEY_ALIASES = ("num_experts", "num_local_experts", "n_routed_experts")

# Multimodal wrappers whose MoE facts live under text_config.
WRAPPERS = {"qwen3_5_moe": "qwen3_5_moe_text", "llama4": "llama4_text"}

GATED_ACTS = {
    "silu": Activation.SILU,
    "swish": Activation.SILU,
    "gelu": Activation.GELU,
    "gelu_pytorch_tanh": Activation.GELU_TANH,
    "gelu_new": Activation.GELU_TANH,
    "gelu_tanh": Activation.GELU_TANH,
}
PLAIN_ACTS = {
    "relu2": Activation.RELU2_NO_MUL,
    "silu": Activation.SILU_NO_MUL,
    "gelu": Activation.GELU_NO_MUL,
}


def _get(cfg: dict[str, Any], key: str, default: Any = _MISSING) -> Any:
    value = cfg.get(key)
    if value is None:
        value = default
    if value is _MISSING:
        raise ConfigError(key, None, "a value in config.json", f"add '{key}' to the config")
    return value


def _number(cfg: dict[str, Any], key: str, default: float) -> float:
    value = _get(cfg, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ConfigError(key, value, "a number")
    return float(value)


def _int_list(cfg: dict[str, Any], key: str, num_layers: int) -> list[int]:
    value = cfg.get(key) or []
    ok = isinstance(value, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < num_layers for v in value
    )
    if not ok:
        raise ConfigError(key, value, f"a list of layer indices in [0, {num_layers})")
    return list(value)


def _positive_int(cfg: dict[str, Any], key: str, default: Any = _MISSING) -> int:
    value = _get(cfg, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, value, "a positive integer")
    return value


def _family_and_dict(raw: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    model_type = raw.get("model_type")
    if model_type in WRAPPERS:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("text_config", text, f"a dict for model_type '{model_type}'")
        merged = {**raw, **text}
        return WRAPPERS[model_type], merged
    if model_type not in FAMILIES:
        known = ", ".join(sorted([*FAMILIES, *WRAPPERS]))
        raise ConfigError(
            "model_type",
            model_type,
            f"one of {known}",
            "use a supported MoE model or a preset (moelora presets)",
        )
    return model_type, raw


def _activation(cfg: dict[str, Any], fam: Family, model_type: str) -> Activation:
    if model_type == "gpt_oss":
        return Activation.SWIGLUOAI
    name = _get(cfg, fam.act_key, "silu")
    table = GATED_ACTS if fam.gated else PLAIN_ACTS
    if not isinstance(name, str) or name not in table:
        kind = "gated" if fam.gated else "non-gated"
        raise ConfigError(fam.act_key, name, f"a {kind} activation: one of {', '.join(table)}")
    return table[name]


def _routing(cfg: dict[str, Any], fam: Family) -> RoutingConfig:
    renorm = fam.renorm if isinstance(fam.renorm, bool) else cfg.get(fam.renorm) or False
    if not isinstance(renorm, bool):
        raise ConfigError(str(fam.renorm), renorm, "true or false")
    n_group, topk_group, scale = 1, 1, 1.0
    if fam.routing in (RoutingMethod.DEEPSEEK_V2, RoutingMethod.DEEPSEEK_V3):
        grouped = fam.routing is RoutingMethod.DEEPSEEK_V3 or (
            cfg.get("topk_method") == "group_limited_greedy"
        )
        if grouped:
            n_group = _positive_int(cfg, "n_group", 1)
            topk_group = _positive_int(cfg, "topk_group", 1)
        scale = _number(cfg, "routed_scaling_factor", 1.0)
    if fam.routing is RoutingMethod.DEEPSEEK_V3 and cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError("scoring_func", cfg["scoring_func"], "'sigmoid' for noaux_tc routing")
    return RoutingConfig(
        fam.routing,
        renormalize=renorm,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=scale,
    )


# NemotronH's per-layer block list, newest key first: transformers 5.24 saves
# layers_block_type (a list; `layer_types` is its attribute alias), older configs the
# hybrid_override_pattern string ("M" mamba, "*" attention, "-" mlp, "E" moe).
_NEMOTRON_BLOCK_KEYS = ("layers_block_type", "layer_types", "hybrid_override_pattern")


def _nemotron_blocks(cfg: dict[str, Any]) -> tuple[str, str | list | None]:
    """(key, the block list or pattern) of a NemotronH config; (key, None) when it has none."""
    key = next((k for k in _NEMOTRON_BLOCK_KEYS if cfg.get(k)), _NEMOTRON_BLOCK_KEYS[-1])
    kinds = cfg.get(key)
    if kinds is not None and not isinstance(kinds, (str, list)):
        raise ConfigError(key, kinds, "a list of block types or a pattern string, one per layer")
    return key, kinds


def _num_layers(cfg: dict[str, Any], fam: Family) -> int:
    """num_hidden_layers, or what it is derived from where the config no longer saves it:
    transformers 5.24's NemotronHConfig makes it a property (the length of
    layers_block_type) and leaves it out of config.json and to_dict()."""
    if fam.layers == "nemotron" and cfg.get("num_hidden_layers") is None:
        _, kinds = _nemotron_blocks(cfg)
        if kinds:
            return len(kinds)
    return _positive_int(cfg, "num_hidden_layers", 1)


def _moe_layers(cfg: dict[str, Any], fam: Family, num_layers: int) -> tuple[int, ...]:
    layers = range(num_layers)
    if fam.layers == "qwen":
        step = _positive_int(cfg, "decoder_sparse_step", 1)
        dense = set(_int_list(cfg, "mlp_only_layers", num_layers))
        return tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
    if fam.layers == "deepseek":
        first = cfg.get("first_k_dense_replace") or 0
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ConfigError("first_k_dense_replace", first, "a non-negative integer")
        freq = _positive_int(cfg, "moe_layer_freq", 1)
        return tuple(i for i in layers if i >= first and i % freq == 0)
    if fam.layers == "nemotron":
        key, kinds = _nemotron_blocks(cfg)
        if kinds is None:
            return tuple(layers)
        if len(kinds) != num_layers:
            raise ConfigError(key, kinds, f"one entry per layer (num_hidden_layers = {num_layers})")
        return tuple(i for i, k in enumerate(kinds) if k in ("E", "moe"))
    if fam.layers == "llama4":
        if cfg.get("moe_layers") is not None:  # an explicit list, possibly empty
            return tuple(_int_list(cfg, "moe_layers", num_layers))
        step = _positive_int(cfg, "interleave_moe_layer_step", 1)
        return tuple(range(step - 1, num_layers, step))
    return tuple(layers)


def _dtype_value(cfg: dict[str, Any]) -> str:
    value = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    if not isinstance(value, str):
        raise ConfigError("dtype", value, "a dtype name such as 'bfloat16'")
    return value


def _experts_key(cfg: dict[str, Any], fam: Family) -> str:
    if cfg.get(fam.experts_key) is not None:
        return fam.experts_key
    return next((k for k in EXPERT_KEY_ALIASES if cfg.get(k) is not None), fam.experts_key)


def hf_fields(raw: dict[str, Any], name: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """config.json -> (MoEShape's fields, its dtype still the config's name for it;
    ModelConfig's other fields)."""
    model_type, cfg = _family_and_dict(raw)
    fam = FAMILIES[model_type]
    hidden = _positive_int(cfg, fam.hidden_key)
    if model_type == "nemotron_h" and cfg.get("moe_latent_size"):
        hidden = _positive_int(cfg, "moe_latent_size")  # experts run in the latent space
    shape = dict(
        num_experts=_positive_int(cfg, _experts_key(cfg, fam)),
        top_k=_positive_int(cfg, "num_experts_per_tok"),
        hidden_size=hidden,
        intermediate_size=_positive_int(cfg, fam.intermediate_key),
        activation=_activation(cfg, fam, model_type),
        has_bias=fam.has_bias,
        dtype=_dtype_value(cfg),
        swiglu_alpha=_number(cfg, "swiglu_alpha", SWIGLUOAI_ALPHA),
        swiglu_limit=_number(cfg, "swiglu_limit", SWIGLUOAI_LIMIT),
    )
    num_layers = _num_layers(cfg, fam)
    model = dict(
        name=name or cfg.get("_name_or_path") or model_type,
        model_type=model_type,
        routing=_routing(cfg, fam),
        num_layers=num_layers,
        moe_layers=_moe_layers(cfg, fam, num_layers),
        quantization=raw.get("quantization_config") or cfg.get("quantization_config"),
    )
    return shape, model
