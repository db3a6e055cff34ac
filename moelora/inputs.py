"""Random layer inputs of a model preset: expert weights, LoRA banks and routed tokens,
the one builder that `moelora validate`, `moelora bench`, benchmarks/ and tests share.

Conventions: build_lora's adapters alternate rank R and R/2 (zero-padded to R in the bank;
build_bank takes each slot's rank instead), and token t takes slot (t + seed) % (L + 1) - 1,
so every (L+1)-th token has no adapter (slot -1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .config import ModelConfig
from .routing import route
from .weights import ExpertWeights, LoRABank, random_expert_weights, random_lora_bank


def build_experts(model: ModelConfig, device: str, seed: int = 0) -> ExpertWeights:
    """The model's expert weights, random, generated on `device`."""
    torch.manual_seed(seed)
    with torch.device(device):  # generate on the device: GBs of weights for DeepSeek-V3
        return random_expert_weights(model.shape, device=device)


def build_lora(model: ModelConfig, adapters: int, rank: int, device: str) -> LoRABank | None:
    """A bank of `adapters` slots of rank `rank` (module docstring), None for 0 adapters."""
    if adapters == 0:
        return None
    ranks = [rank if a % 2 == 0 else max(1, rank // 2) for a in range(adapters)]
    return build_bank(model, ranks, rank, device)


def build_bank(model: ModelConfig, ranks: Sequence[int], max_rank: int, device: str) -> LoRABank:
    """A bank of len(ranks) slots of max rank `max_rank`, slot a holding a random adapter of
    real rank ranks[a] (zero-padded up to max_rank): the banks a benchmark case names."""
    with torch.device(device):  # generate on the device: GBs of fp32 factors at 128 slots
        return random_lora_bank(model.shape, len(ranks), max_rank, ranks=list(ranks), device=device)


# Past each slot's real rank the kernels must read nothing: large, finite in bf16 (1e30
# overflows a bf16 product to inf), so a column read there shows in the output.
PADDING_GARBAGE = 1e4


def with_padding_garbage(bank: LoRABank, value: float = PADDING_GARBAGE) -> LoRABank:
    """A copy of `bank` whose columns past each slot's real rank ([r, R) of every factor)
    hold `value` instead of zeros; the same adapters for any computation that honours the
    ranks (compare it against the clean bank)."""
    out = LoRABank(
        *(t.clone() for t in (bank.w13_a, bank.w13_b, bank.w2_a, bank.w2_b)),
        ranks=bank.ranks.clone(),
        tile_rank=bank.tile_rank,
    )
    for slot, r in enumerate(out.ranks.tolist()):
        for t, dim in ((out.w13_a, 2), (out.w13_b, 3), (out.w2_a, 1), (out.w2_b, 2)):
            t[slot].narrow(dim, r, t.shape[dim + 1] - r).fill_(value)
    return out


def build_inputs(model: ModelConfig, tokens: int, adapters: int, device: str, seed: int):
    """x [T, H], topk_ids [T, K] int32, topk_weights [T, K] fp32, token_slots [T] | None
    (None for 0 adapters): random router logits routed by the model's routing method."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = model.shape
    x = torch.randn(tokens, shape.hidden_size, generator=g, device=device).to(shape.dtype)
    logits = torch.randn(tokens, shape.num_experts, generator=g, device=device)
    bias = torch.zeros(shape.num_experts, device=device)
    ids, weights = route(logits, model.routing, shape.top_k, correction_bias=bias)
    slots = None
    if adapters:
        t = torch.arange(tokens, device=device)
        slots = ((t + seed) % (adapters + 1) - 1).to(torch.int32)
    return x, ids.to(torch.int32).contiguous(), weights.float().contiguous(), slots
