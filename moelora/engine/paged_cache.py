"""The runner's paged KV cache: per attention layer, keys [NB, Hk, BS, Dk] and values
[NB, Hk, BS, Dv], NB blocks of BS positions (blocks.py hands them out; a request's block
table says which hold its positions). Allocated whole at startup from the model's shapes,
so its size is known before the first request; a linear-attention layer (Qwen3.5) keeps no
blocks but a state per block-table row (linear_attention.py). DeepSeek's latent attention
(MLA) keeps one row per position, its normed latent then its rotary key ([c, k_r]: rank +
rope numbers, kernels/mla_attention.py), as keys with one head; its values are the keys'
first `rank` numbers (a view, not stored twice). Legend: NB blocks, BS block size, Hk KV
heads, Dk / Dv key / value width.
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
    values: Tensor  # [NB, Hk, BS, Dv] (MLA: a view of the keys' first Dv numbers)


@dataclass(frozen=True)
class LayerShape:
    """One attention layer's cache: Hk heads of keys Dk and values Dv wide; latent: the
    values are the keys' first Dv numbers (MLA), not stored apart."""

    heads: int
    key_width: int
    value_width: int
    latent: bool = False

    def numbers(self) -> int:
        """Numbers one position holds."""
        return self.heads * (self.key_width + (0 if self.latent else self.value_width))


def layer_shapes(model: nn.Module) -> list[LayerShape | None]:
    """Each decoder layer's cache shape, from its k / v projections; DeepSeek's latent
    attention (MLA): one head of its latent and rotary key, the latent its values; None for
    a linear-attention layer (its state is per row: linear_attention.py)."""
    shapes = []
    for layer in model.model.layers:
        if is_linear(layer):
            shapes.append(None)
            continue
        attn = layer.self_attn
        if hasattr(attn, "kv_b_proj"):  # MLA
            rank = attn.kv_lora_rank
            shapes.append(LayerShape(1, rank + attn.qk_rope_head_dim, rank, latent=True))
            continue
        heads = model.config.num_key_value_heads
        shapes.append(LayerShape(heads, attn.k_proj.out_features // heads,
                                 attn.v_proj.out_features // heads))  # fmt: skip
    return shapes


def bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over every layer, keys and values."""
    size = torch.empty((), dtype=dtype).element_size()
    shapes = [s for s in layer_shapes(model) if s is not None]
    return sum(s.numbers() * block_size * size for s in shapes)


def _layer(shape: LayerShape, num_blocks: int, block_size: int, device, dtype) -> PagedLayer:
    keys = torch.zeros(num_blocks, shape.heads, block_size, shape.key_width, dtype=dtype,
                       device=device)  # fmt: skip
    if shape.latent:
        return PagedLayer(keys, keys[..., : shape.value_width])
    values = torch.zeros(num_blocks, shape.heads, block_size, shape.value_width, dtype=dtype,
                         device=device)  # fmt: skip
    return PagedLayer(keys, values)


class PagedCache:
    """num_blocks blocks of block_size positions in every attention layer of `model`; in
    each linear-attention layer, the state of each of `rows` block-table rows."""

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, device, dtype,
                 rows: int = 0):  # fmt: skip
        self.num_blocks, self.block_size = num_blocks, block_size
        self.layers = [
            None if shape is None else _layer(shape, num_blocks, block_size, device, dtype)
            for shape in layer_shapes(model)
        ]
        self.states = linear_attention.allocate(model, rows, device, dtype)

    def nbytes(self) -> int:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for layer in self.layers if layer for t in (layer.keys, layer.values)}  # fmt: skip
        kv = sum(storages.values())  # MLA's values are a view of its keys: counted once
        return kv + sum(s.conv.nbytes + s.recurrent.nbytes for s in self.states.values())
