"""A per-row static KV cache for the decode engine: a transformers `Cache` whose every
attention layer keeps buffers [N, heads, M, D] in which each row sits at its own position.

transformers' static cache keeps one position for the whole batch; continuous batching needs
one per row (a request joins while others are half way). The engine tells the cache, before
each forward, which rows the forward's batch rows are and at which positions their tokens
go (`plan`); a layer's `update` writes k / v there (index_put_, no host sync, so a CUDA
graph can capture it) and returns the rows' buffers up to `kv_len` keys (a view: decode
reads rows 0 .. B-1, the batch row is the cache row). The engine builds the 4-D attention
mask itself (kv_mask.py), so transformers never asks the cache for mask sizes or offsets.
Buffers are allocated at a layer's first update (k and v may differ in width: DeepSeek's
cached latents), with the shapes the model gives. Legend: N cache rows, M max_len,
B batch rows, S tokens per row, D head width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin


@dataclass
class CachePlan:
    """Where one forward's tokens go: rows [B, 1] long (cache row of each batch row),
    positions [B, S] long; the returned keys are cache rows read_start .. read_start + B - 1,
    positions 0 .. kv_len - 1."""

    rows: Tensor
    positions: Tensor
    read_start: int
    kv_len: int
    gather: bool = False  # read the plan's rows (a prefill of several rows), not a span


class RowLayer(CacheLayerMixin):
    """One attention layer's buffers keys [N, heads, M, D_k], values [N, heads, M, D_v]."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: RowCache) -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        rows, length = self.owner.num_rows, self.owner.max_len
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(rows, key_states.shape[1], length, key_states.shape[-1])
        self.values = value_states.new_zeros(
            rows, value_states.shape[1], length, value_states.shape[-1]
        )
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        """key_states [B, heads, S, D]: written at the plan's rows and positions; returns
        (keys, values) [B, heads, kv_len, D] of those rows."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        plan = self.owner.plan
        # x[rows [B,1], :, positions [B,S]] indexes [B, S, heads, D]: the advanced indices
        # are split by a slice, so their dimensions come first.
        self.keys[plan.rows, :, plan.positions] = key_states.transpose(1, 2)
        self.values[plan.rows, :, plan.positions] = value_states.transpose(1, 2)
        if plan.gather:
            rows = plan.rows[:, 0]
            return self.keys[rows, :, : plan.kv_len], self.values[rows, :, : plan.kv_len]
        span = slice(plan.read_start, plan.read_start + key_states.shape[0])
        return self.keys[span, :, : plan.kv_len], self.values[span, :, : plan.kv_len]

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.owner.plan.kv_len, 0

    def get_seq_length(self) -> int:
        # Rows sit at different positions: there is no one length. transformers asks only
        # when position_ids are missing (the engine always passes them).
        return 0

    def get_max_length(self) -> int:
        return self.owner.max_len


class RowCache(Cache):
    """num_rows cache rows of max_len positions for each of num_layers layers."""

    def __init__(self, num_layers: int, num_rows: int, max_len: int) -> None:
        self.num_rows, self.max_len = num_rows, max_len
        self.plan: CachePlan | None = None
        super().__init__(layers=[RowLayer(self) for _ in range(num_layers)])

    @property
    def allocated(self) -> bool:
        return all(layer.is_initialized for layer in self.layers)

    def nbytes(self) -> int:
        return sum(
            layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer.is_initialized
        )


def plan_prefill(rows: list[int], length: int, device: torch.device) -> CachePlan:
    """Prompts of `length` tokens each into cache rows `rows`, positions 0 .. S-1."""
    index = torch.tensor(rows, device=device)[:, None]
    positions = torch.arange(length, device=device)[None].expand(len(rows), length)
    return CachePlan(index, positions, read_start=rows[0], kv_len=length, gather=len(rows) > 1)


def plan_decode(rows: Tensor, positions: Tensor, kv_len: int) -> CachePlan:
    """One token per batch row b, written to cache row rows[b] (b itself, or a spare row for
    padding) at positions [B, 1]; keys read from cache rows 0 .. B-1."""
    return CachePlan(rows, positions, read_start=0, kv_len=kv_len)
