"""Slot banks of the dense Linear modules an adapter may carry (attention q/k/v/o, shared
experts, dense MLPs, the LM head), beside the expert banks and written with them, one slot
at a time, under the same leases; and the per-token delta they serve.

A dense Linear with per-token adapters is the E = 1, K = 1 case of the expert LoRA:
delta [T, out] = (x_t @ A[s_t]^T) @ B[s_t]^T with the scale folded into B at load. The
delta is computed for every slot at once and masked per token (no host sync, no
data-dependent shape: safe inside a CUDA graph); slot -1 rows get exactly zero.
Legend: T tokens, L slots, R max rank, r an adapter's rank, N in features, M out features.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import AdapterError


@dataclass(frozen=True)
class ModuleLoRA:
    """One adapter on one Linear: a [r, N] and b [M, r] as PEFT saves them, the LoRA scale
    already folded into b."""

    a: Tensor
    b: Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class ModuleShape:
    """Where a module's bank lives: in_features N, out_features M, the module's device and
    dtype (the bank follows its weight)."""

    in_features: int
    out_features: int
    device: torch.device
    dtype: torch.dtype


class ModuleBanks:
    """Per module path: a [L, R, N] and bt [L, R, M] (B transposed, so the expand is one
    matmul over the flattened slot-rank dim), zero where a slot's adapter lacks the module."""

    def __init__(self, shapes: Mapping[str, ModuleShape], num_slots: int, max_rank: int) -> None:
        self.shapes = dict(shapes)
        self.max_rank = max_rank
        self.a: dict[str, Tensor] = {}
        self.bt: dict[str, Tensor] = {}
        for path, s in self.shapes.items():
            kw = dict(device=s.device, dtype=s.dtype)
            self.a[path] = torch.zeros(num_slots, max_rank, s.in_features, **kw)
            self.bt[path] = torch.zeros(num_slots, max_rank, s.out_features, **kw)

    def check(self, source: str, modules: Mapping[str, ModuleLoRA]) -> None:
        """Refuse (before any write) factors for a module without a bank, of another shape,
        or of rank above R."""
        for path, lora in modules.items():
            shape = self.shapes.get(path)
            if shape is None:
                raise AdapterError(
                    source,
                    path,
                    "LoRA on a module attach() gave no bank",
                    f"one of the {len(self.shapes)} modules attach() wrapped",
                    "attach with lora_target_modules naming this module (or None: every Linear)",
                )
            want_a, want_b = (lora.rank, shape.in_features), (shape.out_features, lora.rank)
            if tuple(lora.a.shape) != want_a or tuple(lora.b.shape) != want_b:
                raise AdapterError(
                    source,
                    path,
                    f"a {list(lora.a.shape)}, b {list(lora.b.shape)}",
                    f"a [r, {shape.in_features}], b [{shape.out_features}, r]",
                    "load the adapter for the model it was trained on",
                )
            if lora.rank > self.max_rank:
                raise AdapterError(
                    source,
                    path,
                    f"rank {lora.rank}",
                    f"rank at most max_rank R = {self.max_rank}",
                    "raise max_rank or use a lower-rank adapter",
                )

    def write(self, slot: int, modules: Mapping[str, ModuleLoRA]) -> None:
        """Zero `slot` of every module, then copy the adapter's factors into [:r]."""
        for path in self.shapes:
            self.a[path][slot].zero_()
            self.bt[path][slot].zero_()
            lora = modules.get(path)
            if lora is not None:
                r = lora.rank
                self.a[path][slot, :r].copy_(lora.a, non_blocking=True)
                self.bt[path][slot, :r].copy_(lora.b.T, non_blocking=True)


def dense_lora_delta(x: Tensor, slots: Tensor, a: Tensor, bt: Tensor) -> Tensor:
    """delta [T, M] for x [T, N], slots [T] int (-1: no adapter), a [L, R, N], bt [L, R, M]:
    row t gets (x_t @ a[s_t]^T) @ bt[s_t], rows of slot -1 exactly zero.

    One shrink over every slot (x @ a^T -> [T, L, R]), a mask keeping each token's own slot,
    one expand over the flattened slot-rank dim: static shapes, no host sync. The extra
    work of the other slots is L * R columns per token, small beside the base Linear."""
    num_slots, rank, _ = a.shape
    xa = (x @ a.reshape(num_slots * rank, -1).T).view(-1, num_slots, rank)
    own = slots.view(-1, 1) == torch.arange(num_slots, device=x.device)  # [T, L]
    xa = xa * own.unsqueeze(-1).to(xa.dtype)
    return xa.view(-1, num_slots * rank) @ bt.reshape(num_slots * rank, -1)
