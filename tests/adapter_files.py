"""Test helpers: tiny model configs and adapter directories written from known tensors
(safetensors + adapter_config.json, the way PEFT lays them out)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from moelora import ModelConfig, from_hf
from moelora.lora import Adapter
from moelora.weights import LoRABank

H, INTER, E = 32, 20, 4  # H != I and H != 2I: fused factor shapes are unambiguous
PREFIX = "base_model.model.model.layers.{n}.mlp.experts"
GATED_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
MIXTRAL_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}


def model_config(
    model_type: str = "qwen3_moe", *, hidden: int = H, inter: int = INTER, layers: int = 2
) -> ModelConfig:
    keys = {
        "qwen3_moe": ("num_experts", "moe_intermediate_size", {"norm_topk_prob": True}),
        "mixtral": ("num_local_experts", "intermediate_size", {}),
        "gpt_oss": ("num_local_experts", "intermediate_size", {}),
        "nemotron_h": ("n_routed_experts", "moe_intermediate_size", {"mlp_hidden_act": "relu2"}),
    }
    experts_key, inter_key, extra = keys[model_type]
    cfg = {
        "model_type": model_type, "hidden_size": hidden, experts_key: E, inter_key: inter,
        "num_experts_per_tok": 2, "num_hidden_layers": layers, "torch_dtype": "float32", **extra,
    }  # fmt: skip
    return from_hf(cfg, name=f"tiny-{model_type}")


def lora_config(r: int, alpha: float, **extra: Any) -> dict[str, Any]:
    return {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "rank_pattern": {},
            "alpha_pattern": {}, "use_rslora": False, **extra}  # fmt: skip


def write_adapter(
    root: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any] | None, *, legacy=False
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (root / "adapter_config.json").write_text(json.dumps(config))
    if legacy:
        torch.save(tensors, root / "adapter_model.bin")
    else:
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(root / "adapter_model.safetensors")
        )
    return root


def known_factors(
    mc: ModelConfig, r: int, seed: int = 0
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, part) -> (A [E, r, in], B [E, out, r]), random non-zero; parts gate/up/down
    (gated) or w1/down (non-gated)."""
    g = torch.Generator().manual_seed(seed)
    h, i = mc.shape.hidden_size, mc.shape.intermediate_size
    parts = ("gate", "up", "down") if mc.shape.activation.is_gated else ("w1", "down")
    out = {}
    for layer in mc.moe_layers:
        for part in parts:
            d_in, d_out = (i, h) if part == "down" else (h, i)
            a = torch.randn(E, r, d_in, generator=g) / d_in**0.5
            b = torch.randn(E, d_out, r, generator=g) / r**0.5
            out[(layer, part)] = (a, b)
    return out


def per_expert_tensors(
    factors: dict,
    names: dict[str, str] = GATED_NAMES,
    prefix: str = PREFIX,
    shared: dict | None = None,
) -> dict[str, torch.Tensor]:
    """Layout 1 (and 2: `shared` maps part -> 'A' or 'B', written once without expert index,
    taken from expert 0)."""
    shared = shared or {}
    out = {}
    for (layer, part), (a, b) in factors.items():
        base = prefix.format(n=layer)
        for kind, t in (("A", a), ("B", b)):
            if shared.get(part) == kind:
                out[f"{base}.{names[part]}.lora_{kind}.weight"] = t[0].clone()
            else:
                for e in range(t.shape[0]):
                    out[f"{base}.{e}.{names[part]}.lora_{kind}.weight"] = t[e].clone()
    return out


def write_random_adapter(
    root: Path, mc: ModelConfig, r: int, alpha: float, seed: int = 0, layers: set | None = None
) -> Path:
    """An adapter directory of `known_factors(mc, r, seed)` (rank r on every MoE layer, or
    on `layers` only) in PEFT's per-expert layout, with its adapter_config.json."""
    factors = known_factors(mc, r, seed=seed)
    if layers is not None:
        factors = {key: f for key, f in factors.items() if key[0] in layers}
    return write_adapter(root, per_expert_tensors(factors), lora_config(r, alpha))


def fuse(a: torch.Tensor, b: torch.Tensor, orientation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert (a [E, r, in], b [E, out, r]) -> PEFT's fused (A, B) as saved.

    natural (PEFT 0.21): A [E*r, in] expert-major, B [out, r*E] expert-minor.
    swapped (PEFT 0.17 on [E, out, in] tensors): A [E*r, out], B [in, r*E]."""
    e, r = a.shape[0], a.shape[1]
    if orientation == "natural":
        return a.reshape(e * r, -1), b.permute(1, 2, 0).reshape(b.shape[1], r * e)
    return b.transpose(1, 2).reshape(e * r, -1), a.permute(2, 1, 0).reshape(a.shape[2], r * e)


def fused_tensors(
    mc: ModelConfig,
    factors: dict,
    orientation: str = "natural",
    interleave: bool = False,
    with_down: bool = True,
) -> dict[str, torch.Tensor]:
    """Layout 3 as PEFT saves it: gate_up nested as base_layer, down outer (or gate_up
    alone, unnested, when with_down is False)."""
    out = {}
    for layer in mc.moe_layers:
        base = PREFIX.format(n=layer)
        if mc.shape.activation.is_gated:
            (ga, gb), (ua, ub) = factors[(layer, "gate")], factors[(layer, "up")]
            assert torch.equal(ga, ua), "a fused gate_up LoRA has one A"
            if interleave:  # gpt-oss: rows alternate gate, up
                b13 = torch.stack([gb, ub], 2).reshape(gb.shape[0], -1, gb.shape[2])
            else:
                b13 = torch.cat([gb, ub], 1)
            first = fuse(ga, b13, orientation)
        else:
            first = fuse(*factors[(layer, "w1")], orientation)
        if not with_down:
            out[f"{base}.lora_A.weight"], out[f"{base}.lora_B.weight"] = first
            continue
        down = fuse(*factors[(layer, "down")], orientation)
        out[f"{base}.base_layer.lora_A.weight"], out[f"{base}.base_layer.lora_B.weight"] = first
        out[f"{base}.lora_A.weight"], out[f"{base}.lora_B.weight"] = down
    return out


def bank_of(
    mc: ModelConfig, adapter_at: dict[int, Adapter], layer: int, num_slots: int, max_rank: int
):
    """The fp32 LoRABank of one layer that slot -> adapter implies, built from the adapters
    directly (not by the slot manager): each adapter zero-padded to max_rank R, empty slots
    rank 0 as the manager keeps them. A13 [L, E, S, R, H], B13 [L, E, S, I, R], A2 [L, E, R, I],
    B2 [L, E, H, R]."""
    bank = LoRABank.empty(mc.shape, num_slots, max_rank, dtype=torch.float32)
    bank.ranks.zero_()
    for slot, adapter in adapter_at.items():
        lora, r = adapter.layers[layer], adapter.rank
        bank.ranks[slot] = r
        bank.w13_a[slot, :, :, :r], bank.w13_b[slot, :, :, :, :r] = lora.w13_a, lora.w13_b
        bank.w2_a[slot, :, :r], bank.w2_b[slot, :, :, :r] = lora.w2_a, lora.w2_b
    return bank
