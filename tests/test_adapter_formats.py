"""Adapter files written from known tensors in every layout, loaded and checked element-wise
against those tensors and through a forward of the reference."""

from __future__ import annotations

import math

import adapter_files as af
import pytest
import torch

from moelora import moe_lora_reference, random_expert_weights
from moelora.compare import assert_close
from moelora.errors import AdapterError
from moelora.lora import SlotManager, load_adapter
from moelora.weights import LoRABank

pytestmark = pytest.mark.usefixtures("one_torch_thread")


PART = {"gate": ("w13", 0), "w1": ("w13", 0), "up": ("w13", 1), "down": ("w2", 0)}


def _loaded(adapter, layer: int, part: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [E, r, in], b [E, out, r]) of one part of a loaded adapter."""
    lora = adapter.layers[layer]
    which, s = PART[part]
    if which == "w13":
        return lora.w13_a[:, s], lora.w13_b[:, s]
    return lora.w2_a, lora.w2_b


def _assert_factors(adapter, factors: dict, scale: float | dict) -> None:
    for (layer, part), (a, b) in factors.items():
        got_a, got_b = _loaded(adapter, layer, part)
        r = a.shape[1]
        sc = scale[part] if isinstance(scale, dict) else scale
        torch.testing.assert_close(got_a[:, :r], a, rtol=0, atol=0)
        torch.testing.assert_close(got_b[:, :, :r], b * sc, rtol=1e-6, atol=1e-7)
        assert got_a[:, r:].abs().sum() == 0 and got_b[:, :, r:].abs().sum() == 0


def _manual_bank(mc, factors: dict, scale: float, max_rank: int) -> dict[int, LoRABank]:
    """Slot 0 of a 1-slot bank built by hand from the known factors."""
    banks = {}
    for layer in mc.moe_layers:
        bank = LoRABank.empty(mc.shape, 1, max_rank, dtype=torch.float32)
        for part in ("gate", "up", "w1", "down"):
            if (layer, part) not in factors:
                continue
            a, b = factors[(layer, part)]
            r = a.shape[1]
            which, s = PART[part]
            if which == "w13":
                bank.w13_a[0, :, s, :r], bank.w13_b[0, :, s, :, :r] = a, b * scale
            else:
                bank.w2_a[0, :, :r], bank.w2_b[0, :, :, :r] = a, b * scale
        banks[layer] = bank
    return banks


def _forward_matches(
    mc, path, factors: dict, scale: float, max_rank: int = 8, fused_orientation=None
) -> None:
    """Through the slot manager (rank < R: zero-padded) the forward equals a hand-built bank."""
    manager = SlotManager(mc, num_slots=2, max_rank=max_rank, dtype=torch.float32)
    manager.load(path, name="x", fused_orientation=fused_orientation)
    manual = _manual_bank(mc, factors, scale, max_rank)
    g = torch.Generator().manual_seed(3)
    experts = random_expert_weights(mc.shape, generator=g, dtype=torch.float32)
    t = 10
    x = torch.randn(t, mc.shape.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(mc.shape.num_experts, generator=g)[:2] for _ in range(t)])
    w = torch.rand(t, 2, generator=g)
    snap, slots = manager.token_slots(["x", None] * (t // 2))
    for layer in mc.moe_layers:
        out = moe_lora_reference(x, ids, w, slots, experts, snap.banks[layer], mc.shape)
        ref = moe_lora_reference(
            x, ids, w, torch.where(slots >= 0, 0, -1).int(), experts, manual[layer], mc.shape
        )
        base = moe_lora_reference(x, ids, w, None, experts, None, mc.shape)
        assert_close(out, ref, torch.float32, what=f"layer {layer}")
        assert not torch.allclose(out[0::2], base[0::2], atol=1e-4), "LoRA rows must differ"
        assert torch.equal(out[1::2], base[1::2]), "slot -1 rows are the base output"


# (id, model_type, names, prefix, shared parts) -- the per-expert / shared-outer table
PER_EXPERT_CASES = [
    ("qwen-per-expert", "qwen3_moe", af.GATED_NAMES, None, None),  # gate/up/down_proj names
    ("mixtral-w1w3w2", "mixtral", af.MIXTRAL_NAMES,  # Mixtral names on the old module path
     "base_model.model.model.layers.{n}.block_sparse_moe.experts", None),
    ("shared-outer-vllm", "qwen3_moe", af.GATED_NAMES, None,  # gate/up A and down B shared
     {"gate": "A", "up": "A", "down": "B"}),
    ("shared-inner", "mixtral", af.MIXTRAL_NAMES, None, {"gate": "B", "down": "A"}),
    ("non-gated-relu2", "nemotron_h", {"w1": "up_proj", "down": "down_proj"}, None, None),
]  # fmt: skip


@pytest.mark.parametrize(
    "model_type,names,prefix,shared",
    [c[1:] for c in PER_EXPERT_CASES],
    ids=[c[0] for c in PER_EXPERT_CASES],
)
def test_per_expert_layouts(tmp_path, model_type, names, prefix, shared) -> None:
    mc = af.model_config(model_type)
    r, alpha = 3, 6.0
    factors = af.known_factors(mc, r)
    for (layer, part), (a, b) in factors.items():  # a shared factor is expert 0's everywhere
        kind = (shared or {}).get(part)
        if kind == "A":
            factors[(layer, part)] = (a[:1].expand_as(a).clone(), b)
        elif kind == "B":
            factors[(layer, part)] = (a, b[:1].expand_as(b).clone())
    kw = {"prefix": prefix} if prefix else {}
    tensors = af.per_expert_tensors(factors, names, shared=shared, **kw)
    path = af.write_adapter(tmp_path / "ad", tensors, af.lora_config(r, alpha))
    adapter = load_adapter(path, mc, max_rank=8)
    assert adapter.layout == ("shared_outer" if shared else "per_expert")
    assert adapter.rank == r and adapter.non_expert_modules == ()
    _assert_factors(adapter, factors, alpha / r)
    _forward_matches(mc, path, factors, alpha / r)


# (id, model_type, orientation written, fused_orientation passed, hidden, inter)
FUSED_CASES = [
    ("natural", "qwen3_moe", "natural", None, 32, 20),  # what PEFT 0.21 saves
    ("swapped-peft017", "mixtral", "swapped", None, 32, 20),  # what PEFT 0.17 saved
    ("ambiguous-told-natural", "qwen3_moe", "natural", "natural", 32, 16),  # H == 2I
    ("ambiguous-told-swapped", "qwen3_moe", "swapped", "swapped", 32, 16),
    ("non-gated-told", "nemotron_h", "natural", "natural", 32, 20),  # w1 vs down always ambiguous
    ("gpt-oss-interleaved", "gpt_oss", "natural", None, 32, 16),  # transposed: natural only
]


@pytest.mark.parametrize(
    "model_type,written,told,hidden,inter",
    [c[1:] for c in FUSED_CASES],
    ids=[c[0] for c in FUSED_CASES],
)
def test_fused_layouts(tmp_path, model_type, written, told, hidden, inter) -> None:
    mc = af.model_config(model_type, hidden=hidden, inter=inter)
    r, alpha = 2, 5.0
    factors = af.known_factors(mc, r, seed=1)
    if mc.shape.activation.is_gated:
        for layer in mc.moe_layers:  # one fused gate_up LoRA: gate and up share A
            factors[(layer, "up")] = (factors[(layer, "gate")][0], factors[(layer, "up")][1])
    tensors = af.fused_tensors(mc, factors, written, interleave=model_type == "gpt_oss")
    path = af.write_adapter(tmp_path / "ad", tensors, af.lora_config(r, alpha))
    adapter = load_adapter(path, mc, max_rank=4, fused_orientation=told)
    assert adapter.layout == "fused" and adapter.rank == r
    _assert_factors(adapter, factors, alpha / r)
    if model_type != "gpt_oss":  # gpt-oss forward (swigluoai) is covered by the element check
        _forward_matches(mc, path, factors, alpha / r, max_rank=4, fused_orientation=told)


# (id, model_type, hidden, inter, with_down, ambiguous). The orientation is one per file, so
# a readable down pair settles a square-looking gate_up pair.
AMBIGUITY_CASES = [
    ("H-eq-2I-gate-up-only", "qwen3_moe", 32, 16, False, True),
    ("H-eq-2I-down-settles-it", "qwen3_moe", 32, 16, True, False),
    ("H-eq-I-gate-up-settles-it", "qwen3_moe", 32, 32, True, False),  # down reads both ways
    ("non-gated", "nemotron_h", 32, 20, True, True),  # w1 natural == down swapped
]


@pytest.mark.parametrize(
    "model_type,hidden,inter,with_down,ambiguous",
    [c[1:] for c in AMBIGUITY_CASES],
    ids=[c[0] for c in AMBIGUITY_CASES],
)
def test_ambiguous_fused_is_refused(
    tmp_path, model_type, hidden, inter, with_down, ambiguous
) -> None:
    mc = af.model_config(model_type, hidden=hidden, inter=inter)
    factors = af.known_factors(mc, 2)
    if mc.shape.activation.is_gated:
        for layer in mc.moe_layers:
            factors[(layer, "up")] = (factors[(layer, "gate")][0], factors[(layer, "up")][1])
    tensors = af.fused_tensors(mc, factors, with_down=with_down)
    path = af.write_adapter(tmp_path / "ad", tensors, af.lora_config(2, 2))
    if ambiguous:
        with pytest.raises(AdapterError, match="fused_orientation"):
            load_adapter(path, mc, max_rank=4)
    else:
        if not with_down:
            factors = {k: v for k, v in factors.items() if k[1] != "down"}
        _assert_factors(load_adapter(path, mc, max_rank=4), factors, 1.0)


def test_swapped_matches_peft_017_delta_formula(tmp_path) -> None:
    """PEFT 0.17.1 ParamWrapper.get_delta_weight on a 3-D param (E, in, out) computed
    einsum('o r e, e r i -> e i o', B.reshape(o, r, E), A.reshape(E, r, i)) -- for Mixtral's
    gate_up_proj [E, 2I, H] that is the weight delta in the param's own layout."""
    mc = af.model_config("mixtral")
    factors = af.known_factors(mc, 3, seed=5)
    for layer in mc.moe_layers:
        factors[(layer, "up")] = (factors[(layer, "gate")][0], factors[(layer, "up")][1])
    tensors = af.fused_tensors(mc, factors, "swapped")
    adapter = load_adapter(af.write_adapter(tmp_path / "ad", tensors, af.lora_config(3, 3)), mc, 4)
    key = "base_model.model.model.layers.0.mlp.experts.base_layer"
    a_saved, b_saved = tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"]
    ref = torch.einsum(
        "o r e, e r i -> e i o", b_saved.reshape(b_saved.shape[0], 3, 4), a_saved.reshape(4, 3, -1)
    )
    lora = adapter.layers[0]
    out = torch.cat([lora.w13_b[:, s] @ lora.w13_a[:, s] for s in (0, 1)], 1)  # [E, 2I, H]
    assert_close(out, ref, torch.float32)


def test_scaling_rslora_and_patterns(tmp_path) -> None:
    """rsLoRA alpha/sqrt(r); rank_pattern / alpha_pattern per module (regex, PEFT matching)."""
    mc = af.model_config("qwen3_moe")
    factors = af.known_factors(mc, 4)
    for (layer, part), (a, b) in list(factors.items()):
        if part == "down":  # down trained at rank 2 by rank_pattern
            factors[(layer, part)] = (a[:, :2].clone(), b[:, :, :2].clone())
    cfg = af.lora_config(4, 8, use_rslora=True, rank_pattern={"down_proj": 2},
                      alpha_pattern={r".*\.up_proj": 3})  # fmt: skip
    path = af.write_adapter(tmp_path / "ad", af.per_expert_tensors(factors), cfg)
    adapter = load_adapter(path, mc, max_rank=8)
    _assert_factors(adapter, factors, {"gate": 8 / 2.0, "up": 3 / 2.0, "down": 8 / math.sqrt(2)})


def test_legacy_bin_loads_like_safetensors(tmp_path) -> None:
    mc = af.model_config("qwen3_moe")
    factors = af.known_factors(mc, 2)
    tensors = af.per_expert_tensors(factors)
    legacy = load_adapter(
        af.write_adapter(tmp_path / "b", tensors, af.lora_config(2, 2), legacy=True), mc, 4
    )
    _assert_factors(legacy, factors, 1.0)


def test_attention_only_adapter_loads_empty_where_attention_is_served(tmp_path) -> None:
    """LoRA on attention only: refused for the expert layers alone (it would change nothing
    there); a caller serving attention elsewhere gets it with no expert layers (rank 0) and
    the modules reported. tests/test_adapter_targets.py has the whole table."""
    mc = af.model_config("qwen3_moe")
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {
        f"{key}.lora_A.weight": torch.randn(2, 32),
        f"{key}.lora_B.weight": torch.randn(32, 2),
    }
    path = af.write_adapter(tmp_path / "a", tensors, af.lora_config(2, 2))
    with pytest.raises(AdapterError, match="no LoRA on the routed experts"):
        load_adapter(path, mc, 4)
    adapter = load_adapter(path, mc, 4, serves_non_expert=True)
    assert adapter.layout == "none" and adapter.rank == 0 and adapter.layers == {}
    assert adapter.non_expert_modules == (key,)
