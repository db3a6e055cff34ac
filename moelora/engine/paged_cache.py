"""The runner's paged KV cache: per attention layer, keys [NB, Hk, BS, Dk] and values
[NB, Hk, BS, Dv], NB blocks of BS positions (blocks.py hands them out; a request's block
table says which hold its positions). Allocated whole at startup from the model's shapes,
so its size is known before the first request. Legend: NB blocks, BS block size, Hk KV
heads, Dk / Dv key / value width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass
class PagedLayer:
    keys: Tensor  # [NB, Hk, BS, Dk]
    values: Tensor  # [NB, Hk, BS, Dv]


def layer_shapes(model: nn.Module) -> list[tuple[int, int, int]]:
    """(Hk, Dk, Dv) of each decoder layer's attention, from its k / v projections; DeepSeek's
    latent attention (MLA): its keys and values expanded per query head, the values as wide
    as the keys (the runner pads them: its attention kernels take one width)."""
    shapes = []
    for layer in model.model.layers:
        attn = layer.self_attn
        if hasattr(attn, "kv_b_proj"):  # MLA
            width = attn.qk_nope_head_dim + attn.qk_rope_head_dim
            shapes.append((attn.num_heads, width, width))
            continue
        heads = model.config.num_key_value_heads
        shapes.append((heads, attn.k_proj.out_features // heads, attn.v_proj.out_features // heads))
    return shapes


def bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over every layer, keys and values."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(h * (dk + dv) * block_size * size for h, dk, dv in layer_shapes(model))


class PagedCache:
    """num_blocks blocks of block_size positions in every layer of `model`."""

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, device, dtype):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.layers = [
            PagedLayer(
                torch.zeros(num_blocks, h, block_size, dk, dtype=dtype, device=device),
                torch.zeros(num_blocks, h, block_size, dv, dtype=dtype, device=device),
            )
            for h, dk, dv in layer_shapes(model)
        ]

    def nbytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)
