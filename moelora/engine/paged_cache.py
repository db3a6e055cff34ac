"""The runner's paged KV cache: per attention layer, keys [NB, Hk, BS, Dk] and values
[NB, Hk, BS, Dv], NB blocks of BS positions (blocks.py hands them out; a request's block
table says which hold its positions). Allocated whole at startup from the model's shapes,
so its size is known before the first request; a linear-attention layer (Qwen3.5) keeps no
blocks but a state per block-table row (linear_attention.py). Legend: NB blocks, BS block
size, Hk KV heads, Dk / Dv key / value width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from . import linear_attention
from .linear_attention import is_linear


@dataclass
class PagedLayer:
    keys: Tensor  # [NB, Hk, BS, Dk]
    values: Tensor  # [NB, Hk, BS, Dv]


def layer_shapes(model: nn.Module) -> list[tuple[int, int, int] | None]:
    """(Hk, Dk, Dv) of each decoder layer's attention, from its k / v projections; DeepSeek's
    latent attention (MLA): its keys and values expanded per query head, the values as wide
    as the keys (the runner pads them: its attention kernels take one width); None for a
    linear-attention layer (its state is per row: linear_attention.py)."""
    shapes = []
    for layer in model.model.layers:
        if is_linear(layer):
            shapes.append(None)
            continue
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
    shapes = [s for s in layer_shapes(model) if s is not None]
    return sum(h * (dk + dv) * block_size * size for h, dk, dv in shapes)


class PagedCache:
    """num_blocks blocks of block_size positions in every attention layer of `model`; in
    each linear-attention layer, the state of each of `rows` block-table rows."""

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, device, dtype,
                 rows: int = 0):  # fmt: skip
        self.num_blocks, self.block_size = num_blocks, block_size
        self.layers = [
            None if shape is None else PagedLayer(
                torch.zeros(num_blocks, shape[0], block_size, shape[1], dtype=dtype,
                            device=device),
                torch.zeros(num_blocks, shape[0], block_size, shape[2], dtype=dtype,
                            device=device),
            )
            for shape in layer_shapes(model)
        ]  # fmt: skip
        self.states = linear_attention.allocate(model, rows, device, dtype)

    def nbytes(self) -> int:
        kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer)
        return kv + sum(s.conv.nbytes + s.recurrent.nbytes for s in self.states.values())
