"""The operands of benchmarks/gemm_ceiling.py, built before anything is timed, and the
`Variant` record of one timed call.

Legend: T tokens, P = T * top_k pairs, E experts, H hidden, I intermediate, N = S * I.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from moelora.config import ModelConfig
from moelora.inputs import build_experts, build_inputs
from moelora.weights import ExpertWeights


class Variant(NamedTuple):
    """One timed call: fn(*static), the FLOPs it does, and (optionally) its expected output
    at some rows, built lazily: ref() -> (row ids [R], fp32 [R, N]), checked before timing."""

    fn: Callable
    static: tuple
    flops: float
    ref: Callable[[], tuple[Tensor, Tensor]] | None = None


@dataclass(frozen=True)
class Operands:
    """The bf16 operands of one T: rows [P, H] (x gathered, sorted by expert), z [P, I],
    offs [E] int32 (each expert's row end), the experts (w13 [E, N, H], w2 [E, H, I]) and the
    dense rows' weights dense13 [H, N], dense2 [I, H]."""

    rows: Tensor
    z: Tensor
    offs: Tensor
    experts: ExpertWeights
    dense13: Tensor
    dense2: Tensor

    @property
    def flops_up(self) -> float:
        return 2.0 * self.rows.shape[0] * self.rows.shape[1] * self.experts.w13.shape[1]

    @property
    def flops_down(self) -> float:
        return 2.0 * self.z.shape[0] * self.z.shape[1] * self.experts.w2.shape[1]


def build_operands(model: ModelConfig, tokens: int, device: str) -> Operands:
    """The bench's routing at seed 0 (build_inputs), rows gathered and sorted by expert, in
    bf16 whatever the preset's dtype (these are bf16 GEMMs)."""
    s = model.shape
    bf16 = torch.bfloat16
    experts = build_experts(model, device)
    experts = ExpertWeights(experts.w13.to(bf16), experts.w2.to(bf16))
    x, ids, _, _ = build_inputs(model, tokens, 0, device, 0)
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=s.num_experts)
    rows = x[order // s.top_k].to(bf16).contiguous()
    z = torch.randn(rows.shape[0], s.intermediate_size, device=device).to(bf16)
    n13 = experts.w13.shape[1]
    return Operands(
        rows=rows,
        z=z,
        offs=torch.cumsum(counts, 0).to(torch.int32),
        experts=experts,
        dense13=torch.randn(s.hidden_size, n13, device=device).to(bf16),
        dense2=torch.randn(s.intermediate_size, s.hidden_size, device=device).to(bf16),
    )
