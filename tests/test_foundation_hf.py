"""Outside truth: Hugging Face transformers' own MoE blocks, tiny random one-layer models
built from moelora.hf.toy's family configs. moelora's from_hf, routing and reference must
match the block (LoRA off, fp32), and its routing must match the block's own router (ids
and weights)."""

from __future__ import annotations

import pytest
import torch
import transformers

from moelora import from_hf, moe_lora_reference, route
from moelora.compare import assert_close
from moelora.hf import expert_weights_from_hf, router_from_hf, router_logits, toy

pytestmark = pytest.mark.filterwarnings("ignore")


def _one_layer(model_type: str, **changes) -> dict:
    """The tiny family of moelora.hf.toy (the one the hf tests run), cut to its one MoE block
    (I = 12 so that S*I != H)."""
    return dict(toy.FAMILIES[model_type], num_hidden_layers=1, **changes)


# (model_type, extra config, shared-expert path to subtract)
FAMILIES = [
    ("qwen3_moe", _one_layer("qwen3_moe"), None),
    ("mixtral", _one_layer("mixtral"), None),
    ("olmoe", _one_layer("olmoe"), None),
    # DeepSeek-V3: sigmoid + correction bias + grouped top-k + scaling factor; K=3 of 8
    ("deepseek_v3", _one_layer("deepseek_v3", first_k_dense_replace=0), "shared_experts"),
    # DeepSeek-V2 group-limited greedy (softmax, groups by max), V2's default norm_topk_prob
    (
        "deepseek_v2",
        _one_layer("deepseek_v3", first_k_dense_replace=0, topk_method="group_limited_greedy",
                   routed_scaling_factor=1.5, norm_topk_prob=False),
        "shared_experts",
    ),
    # gpt-oss: swigluoai, interleaved gate/up, biases, router bias, top-k then softmax
    ("gpt_oss", _one_layer("gpt_oss", layer_types=["full_attention"]), None),
    # NemotronH: non-gated relu2 experts, DeepSeek-V3 style routing
    ("nemotron_h", _one_layer("nemotron_h", hybrid_override_pattern="E"), "shared_experts"),
    # Llama-4: top-1 sigmoid weight applied to the expert input
    ("llama4_text", _one_layer("llama4_text"), "shared_expert"),
    (
        "qwen3_5_moe_text",
        _one_layer("qwen3_5_moe_text", layer_types=["full_attention"]),
        "qwen_shared",
    ),
]  # fmt: skip


def _build(model_type: str, extra: dict, seed: int):
    cfg = transformers.AutoConfig.for_model(model_type, **{**toy.COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    name = next(n for n, m in model.named_modules() if hasattr(m, "experts"))
    block = model.get_submodule(name)
    with torch.no_grad():  # fresh random non-zero weights everywhere in the block
        for p in block.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        for b in block.buffers():
            if b.is_floating_point():
                b.copy_(torch.randn_like(b) * 0.1)
    return cfg, block


def _shared(block, kind: str | None, x: torch.Tensor) -> torch.Tensor:
    if kind is None:
        return torch.zeros_like(x)
    if kind == "qwen_shared":
        return torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return getattr(block, kind)(x)


def _block_out(block, x: torch.Tensor) -> torch.Tensor:
    out = block(x.unsqueeze(0))
    out = out[0] if isinstance(out, tuple) else out
    return out.reshape(x.shape)


@pytest.mark.parametrize("family", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_block_matches_transformers(family, seed):
    model_type, extra, shared = family
    cfg, block = _build(model_type, extra, seed)
    model = from_hf(cfg.to_dict())  # the real HF config dict goes through the one parser
    x = torch.randn(13, toy.COMMON["hidden_size"])
    with torch.no_grad():
        ref = _block_out(block, x) - _shared(block, shared, x)
    _, correction = router_from_hf(block)
    ids, weights = route(router_logits(block, x), model.routing, model.shape.top_k, correction)
    experts = expert_weights_from_hf(block.experts, model)
    out = moe_lora_reference(
        x,
        ids,
        weights,
        None,
        experts,
        None,
        model.shape,
        weights_on_input=model.routing.method.weights_on_input,
    )
    assert_close(out, ref, torch.float32, what=model_type)
    assert ref.abs().max() > 1e-2  # a non-trivial output: the comparison can fail


ROUTED = [f for f in FAMILIES if f[0] != "llama4_text"]  # Llama-4's router returns dense scores


@pytest.mark.parametrize("family", ROUTED, ids=[f[0] for f in ROUTED])
def test_routing_matches_transformers_router(family, seed):
    model_type, extra, _ = family
    cfg, block = _build(model_type, extra, seed)
    model = from_hf(cfg.to_dict())
    x = torch.randn(17, toy.COMMON["hidden_size"])
    router, correction = router_from_hf(block)
    with torch.no_grad():
        _, hf_weights, hf_ids = router(x)
    ids, weights = route(router_logits(block, x), model.routing, model.shape.top_k, correction)
    # Compare as sets per token: order within the top-k is not part of the contract.
    order_hf, order_ml = hf_ids.argsort(dim=-1), ids.long().argsort(dim=-1)
    assert torch.equal(hf_ids.gather(1, order_hf), ids.long().gather(1, order_ml))
    assert_close(
        weights.gather(1, order_ml),
        hf_weights.float().gather(1, order_hf),
        torch.float32,
        what=model_type,
    )


def test_llama4_router_scores_match(seed):
    model_type, extra, _ = next(f for f in FAMILIES if f[0] == "llama4_text")
    cfg, block = _build(model_type, extra, seed)
    model = from_hf(cfg.to_dict())
    x = torch.randn(9, toy.COMMON["hidden_size"])
    with torch.no_grad():
        dense_scores, _ = block.router(x)  # [T, E], zero except the chosen expert
    ids, weights = route(router_logits(block, x), model.routing, 1)
    dense = torch.zeros_like(dense_scores).scatter_(1, ids.long(), weights)
    assert_close(dense, dense_scores, torch.float32, what="llama4")
