"""from_hf, presets and the config dataclasses: good configs parse, bad ones raise ConfigError
naming the key, the value and what was expected."""

from __future__ import annotations

import json

import pytest
import torch

from moelora import (
    PRESETS,
    Activation,
    ConfigError,
    LoRAConfig,
    MoEShape,
    ParallelConfig,
    RoutingMethod,
    from_hf,
    load_preset,
    resolve_model,
)
from moelora.presets import preset_dict

# (preset, E, K, H, I, activation, routing method, MoE layer count)
EXPECTED = [
    ("qwen3-30b-a3b", 128, 8, 2048, 768, Activation.SILU, RoutingMethod.SOFTMAX_TOPK, 48),
    ("qwen3.5-35b-a3b", 256, 8, 2048, 512, Activation.SILU, RoutingMethod.SOFTMAX_TOPK, 40),
    ("mixtral-8x7b", 8, 2, 4096, 14336, Activation.SILU, RoutingMethod.SOFTMAX_TOPK, 32),
    ("olmoe-1b-7b", 64, 8, 2048, 1024, Activation.SILU, RoutingMethod.SOFTMAX_TOPK, 16),
    ("deepseek-v2-lite", 64, 6, 2048, 1408, Activation.SILU, RoutingMethod.DEEPSEEK_V2, 26),
    ("deepseek-v3", 256, 8, 7168, 2048, Activation.SILU, RoutingMethod.DEEPSEEK_V3, 58),
    ("gpt-oss-20b", 32, 4, 2880, 2880, Activation.SWIGLUOAI, RoutingMethod.TOPK_SOFTMAX, 24),
    ("nemotron-h", 128, 6, 2688, 1856, Activation.RELU2_NO_MUL, RoutingMethod.DEEPSEEK_V3, 2),
    ("llama4-scout", 16, 1, 5120, 8192, Activation.SILU, RoutingMethod.LLAMA4, 48),
]


@pytest.mark.parametrize("row", EXPECTED, ids=[r[0] for r in EXPECTED])
def test_presets_parse(row):
    name, e, k, h, i, act, method, moe_layers = row
    m = load_preset(name)
    assert (m.shape.num_experts, m.shape.top_k, m.shape.hidden_size) == (e, k, h)
    assert m.shape.intermediate_size == i and m.shape.activation is act
    assert m.routing.method is method and len(m.moe_layers) == moe_layers
    assert m.shape.dtype is torch.bfloat16


def test_every_preset_parses_and_deepseek_details():
    for name in PRESETS:
        load_preset(name)
    v3 = load_preset("deepseek-v3").routing
    assert (v3.n_group, v3.topk_group, v3.routed_scaling_factor, v3.renormalize) == (
        8,
        4,
        2.5,
        True,
    )
    assert load_preset("gpt-oss-20b").shape.has_bias


def test_from_hf_reads_a_config_json_path(tmp_path):
    path = tmp_path / "my-model" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(preset_dict("mixtral-8x7b")))
    assert from_hf(path).shape == load_preset("mixtral-8x7b").shape
    assert resolve_model(str(path)).name == "my-model"


def _bad(name: str, **changes):
    cfg = preset_dict(name)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    return cfg


# (id, config dict, key named in the error, fragment of what was expected)
BAD = [
    ("unknown-model-type", _bad("tiny", model_type="llama"), "model_type", "one of"),
    ("missing-hidden", _bad("tiny", hidden_size=None), "hidden_size", "a value"),
    (
        "missing-experts",
        _bad("mixtral-8x7b", num_local_experts=None),
        "num_local_experts",
        "a value",
    ),
    (
        "zero-intermediate",
        _bad("tiny", moe_intermediate_size=0),
        "moe_intermediate_size",
        "positive",
    ),
    ("negative-topk", _bad("tiny", num_experts_per_tok=-2), "num_experts_per_tok", "positive"),
    ("topk-above-E", _bad("tiny", num_experts_per_tok=9), "top_k", "at most num_experts"),
    ("float-experts", _bad("tiny", num_experts=8.5), "num_experts", "positive integer"),
    ("bad-activation", _bad("tiny", hidden_act="tanh"), "hidden_act", "gated activation"),
    (
        "gated-act-on-nongated",
        _bad("tiny-relu2", mlp_hidden_act="gelu_pytorch_tanh"),
        "mlp_hidden_act",
        "non-gated",
    ),
    ("bad-dtype", _bad("tiny", torch_dtype="int8"), "dtype", "bfloat16"),
    ("group-not-divisor", _bad("deepseek-v3", n_group=7), "n_group", "divisor"),
    ("topk-group-above-n-group", _bad("deepseek-v3", topk_group=9), "topk_group", "n_group"),
    (
        "groups-too-few-experts",
        _bad("deepseek-v3", topk_group=1, num_experts_per_tok=40),
        "topk_group",
        "top_k",
    ),
    ("softmax-scoring-v3", _bad("deepseek-v3", scoring_func="softmax"), "scoring_func", "sigmoid"),
    (
        "llama4-top2",
        {
            **preset_dict("llama4-scout"),
            "text_config": {**preset_dict("llama4-scout")["text_config"], "num_experts_per_tok": 2},
        },
        "num_experts_per_tok",
        "1",
    ),
    ("wrapper-without-text", {"model_type": "qwen3_5_moe"}, "text_config", "dict"),
    # malformed values must raise ConfigError, never a TypeError/ValueError from deep inside
    ("act-not-a-string", _bad("tiny", hidden_act=["silu"]), "hidden_act", "gated activation"),
    (
        "scale-not-a-number",
        _bad("deepseek-v3", routed_scaling_factor="x"),
        "routed_scaling_factor",
        "number",
    ),
    ("limit-not-a-number", _bad("gpt-oss-20b", swiglu_limit="7"), "swiglu_limit", "number"),
    ("renorm-not-bool", _bad("tiny", norm_topk_prob="yes"), "norm_topk_prob", "true or false"),
    ("dense-layers-not-list", _bad("tiny", mlp_only_layers=5), "mlp_only_layers", "layer indices"),
    ("dense-layer-out-of-range", _bad("tiny", mlp_only_layers=[7]), "mlp_only_layers", "[0, 2)"),
    (
        "first-dense-not-int",
        _bad("deepseek-v3", first_k_dense_replace="x"),
        "first_k_dense_replace",
        "non-negative",
    ),
    (
        "pattern-length",
        _bad("tiny-relu2", hybrid_override_pattern="MEME"),
        "hybrid_override_pattern",
        "one entry per layer",
    ),
    ("dtype-not-a-string", _bad("tiny", torch_dtype=16), "dtype", "dtype name"),
    (
        "block-list-not-a-list",
        _bad("tiny-relu2", hybrid_override_pattern=None, layers_block_type=5),
        "layers_block_type",
        "a list of block types",
    ),
    # DeepSeek-V2 group-limited greedy: kept groups must hold top_k experts
    (
        "v2-groups-too-few",
        _bad(
            "deepseek-v2-lite",
            topk_method="group_limited_greedy",
            n_group=8,
            topk_group=1,
            num_experts_per_tok=12,
        ),
        "topk_group",
        "top_k",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_configs_raise_named_errors(case):
    _, cfg, key, expected = case
    with pytest.raises(ConfigError) as err:
        from_hf(cfg)
    assert err.value.key == key
    assert expected in err.value.expected
    assert key in str(err.value)


def test_bad_paths_and_json(tmp_path):
    with pytest.raises(ConfigError, match=r"existing config\.json"):
        from_hf(tmp_path / "absent.json")
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="valid JSON"):
        from_hf(broken)
    with pytest.raises(ConfigError, match="preset"):
        resolve_model("no-such-model")


def test_dataclass_validation():
    with pytest.raises(ConfigError, match="top_k"):
        MoEShape(4, 5, 8, 8, Activation.SILU)
    # at tp 1 fully sharded LoRA has nothing to split: a no-op, stored as what runs (issue 17)
    assert ParallelConfig(tp=1, ep=2, fully_sharded_loras=True) == ParallelConfig(tp=1, ep=2)
    assert ParallelConfig(tp=2, fully_sharded_loras=True).fully_sharded_loras
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        ParallelConfig(tp=0)
    with pytest.raises(ConfigError, match="'max_rank'"):
        LoRAConfig(enabled=True, max_rank=0)
    with pytest.raises(ConfigError, match="'num_slots'"):  # the keyword the caller typed
        LoRAConfig(enabled=True, num_slots=0)
    assert not LoRAConfig(enabled=True, targets=("q_proj", "v_proj")).on_experts
    assert LoRAConfig(enabled=True, targets=("down_proj",)).on_experts
    assert not LoRAConfig(enabled=False).on_experts
    assert LoRAConfig(enabled=True, targets=("all-linear",)).on_experts  # may reach experts
    # PEFT regex targets: one that matches expert modules counts, an attention-only one not
    assert LoRAConfig(enabled=True, targets=(r".*\.experts\..*_proj",)).on_experts
    assert not LoRAConfig(enabled=True, targets=(r".*self_attn\.(q|v)_proj",)).on_experts


# NemotronH configs as transformers 5.24 saves them: no num_hidden_layers, derived from the
# block list. (id, keys replacing the preset's pattern, layers, MoE layers)
NEMOTRON_BLOCKS = [
    ("list-without-count", {"layers_block_type": ["moe", "full_attention", "moe"]}, 3, (0, 2)),
    ("alias-layer-types", {"layer_types": ["mlp", "moe"]}, 2, (1,)),
    ("pattern-without-count", {"hybrid_override_pattern": "M*EE"}, 4, (2, 3)),
]


@pytest.mark.parametrize(
    "keys,layers,moe", [c[1:] for c in NEMOTRON_BLOCKS], ids=[c[0] for c in NEMOTRON_BLOCKS]
)
def test_nemotron_layer_count_is_derived_from_the_block_list(keys, layers, moe):
    cfg = _bad("tiny-relu2", num_hidden_layers=None, hybrid_override_pattern=None)
    m = from_hf({**cfg, **keys})
    assert (m.num_layers, m.moe_layers) == (layers, moe)


def test_llama4_explicit_empty_moe_layers_means_none():
    cfg = preset_dict("llama4-scout")
    cfg["text_config"]["moe_layers"] = []
    assert from_hf(cfg).moe_layers == ()
    cfg["text_config"]["moe_layers"] = [1, 3]
    assert from_hf(cfg).moe_layers == (1, 3)


def test_values_are_normalised_on_construction():
    shape = MoEShape(4, 2, 8, 8, "relu2_no_mul", dtype="bf16")
    assert shape.dtype is torch.bfloat16 and shape.activation is Activation.RELU2_NO_MUL
    with pytest.raises(ConfigError, match="top_k"):
        MoEShape(4, True, 8, 8, Activation.SILU)
    with pytest.raises(ConfigError, match="activation"):
        MoEShape(4, 2, 8, 8, "swish-ish")
    # a plain string is one target, not a tuple of characters
    assert LoRAConfig(enabled=True, targets="down_proj").targets == ("down_proj",)
    assert LoRAConfig(enabled=True, targets="down_proj").on_experts


def test_route_refuses_bad_top_k_and_handles_one_group():
    from moelora import RoutingConfig, route
    from moelora.compare import assert_close

    logits = torch.randn(5, 4)
    with pytest.raises(ConfigError, match="top_k"):
        route(logits, RoutingConfig(RoutingMethod.SOFTMAX_TOPK), 5)
    with pytest.raises(ConfigError, match="llama4"):
        route(logits, RoutingConfig(RoutingMethod.LLAMA4), 2)
    one = RoutingConfig(RoutingMethod.DEEPSEEK_V3, renormalize=True)
    ids, weights = route(torch.randn(3, 1), one, 1)  # E = 1, one group: no top-2 scoring
    assert ids.tolist() == [[0], [0], [0]]
    assert_close(weights, torch.ones(3, 1), torch.float32)
