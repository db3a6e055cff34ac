"""The 4-D attention masks the decode engine gives the model, one per layer type.

Rows sit at different positions of the per-row cache (kv_cache.py), which transformers' mask
functions cannot describe; a 4-D mask passes through them untouched (masking_utils, 5.17 and
5.24). Families whose layers differ in type (sliding / chunked / full: gpt-oss, Llama 4,
Qwen3.5) take a dict layer type -> mask; the others one mask, sliding when their config
sets `sliding_window` (Qwen3-MoE, Mixtral choose so). The rules are transformers' own:
causal, plus `kv > q - window` (sliding) or `kv // chunk == q // chunk` (chunked).
Built from a positions tensor on the device, so a CUDA graph captures the build too.
Legend: B rows, S query tokens per row, K key positions (kv_len).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# Layer types without attention and without state (NemotronH's routed-experts blocks).
STATELESS_TYPES = ("moe", "mlp")


@dataclass(frozen=True)
class MaskRule:
    """keyed: the model takes a dict layer type -> mask; windows: layer type -> (kind, size),
    kind one of ATTENTION_TYPES, size the window or chunk (None for full attention)."""

    keyed: bool
    windows: tuple[tuple[str, str, int | None], ...]  # (layer type, kind, size)


def mask_rule(config) -> MaskRule:
    """The mask rule of a transformers config (every layer type must be an attention type:
    engine_support() checks that first)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        kinds = sorted(set(layer_types) & set(ATTENTION_TYPES))
        windows = tuple((t, t, _size(config, t)) for t in kinds)
        return MaskRule(keyed=True, windows=windows)
    window = getattr(config, "sliding_window", None)
    if window is None:
        return MaskRule(keyed=False, windows=(("", "full_attention", None),))
    return MaskRule(keyed=False, windows=(("", "sliding_attention", int(window)),))


def _size(config, kind: str) -> int | None:
    if kind == "sliding_attention":
        return int(config.sliding_window)
    if kind == "chunked_attention":
        return int(config.attention_chunk_size)
    return None


def build_masks(rule: MaskRule, positions: Tensor, kv_len: int, dtype: torch.dtype):
    """positions [B, S] long -> mask [B, 1, S, K] (0 where a query sees a key, dtype's
    minimum elsewhere), or a dict layer type -> such a mask when rule.keyed."""
    masks = {name: _mask(kind, size, positions, kv_len, dtype) for name, kind, size in rule.windows}
    return masks if rule.keyed else masks[""]


def _mask(kind: str, size: int | None, positions: Tensor, kv_len: int, dtype) -> Tensor:
    q = positions[:, None, :, None]  # [B, 1, S, 1]
    kv = torch.arange(kv_len, device=positions.device)[None, None, None, :]  # [1, 1, 1, K]
    seen = kv <= q
    if kind == "sliding_attention":
        seen = seen & (kv > q - size)
    elif kind == "chunked_attention":
        seen = seen & (kv // size == q // size)
    zero = torch.zeros((), dtype=dtype, device=positions.device)
    return torch.where(seen, zero, torch.finfo(dtype).min)
