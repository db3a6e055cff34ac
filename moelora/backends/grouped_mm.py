"""The `grouped_mm` backend: the two base GEMMs on `torch._grouped_mm` (one group per local
expert), activation, biases and LoRA deltas in plain torch ops with fp32 rank intermediates.

Pairs (token, j) are sorted by expert; ids outside [0, E_l) (expert parallel) sort last and
contribute zero. Legend: T tokens, K top-k, N = T*K pairs, H hidden, I_p intermediate.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..activations import apply_activation, split_gate_up
from ..call import MoECall
from ..config import AddInputs, MoEShape
from ..deployment import LoRASharding, ParallelMode
from ..errors import InputError
from ..weights import ExpertWeights, LoRABank
from .base import write_output
from .capabilities import (
    ALL_ACTIVATIONS,
    ALL_GATING,
    ALL_ROUTING,
    FULL_PRECISION_ONLY,
    Capabilities,
    Validation,
)

# Where this record has run (docs/history/benchmarks.md, 2026-11-30, commit 7fff9c4): one GPU, bf16 only.
VALIDATED_ON = (
    Validation("NVIDIA H200", "cuda", (9, 0), frozenset({torch.bfloat16}), "2026-11-30",
               "moelora validate --backends grouped_mm --quick at 7fff9c4: 45/45 pass (the "
               "five models, T 1..16384, 8 adapters rank 16, eager)",
               "docs/history/benchmarks.md, 2026-11-30 (the commit 28cc3e4 section); "
               "h200_7fff9c4_validate_grouped_mm_quick.log in benchmarks/results/h200_validate.txt"),
)  # fmt: skip


CAPABILITIES = Capabilities(
    devices=frozenset({"cuda"}),
    # torch's CUDA grouped GEMM is built for Hopper and newer (CUTLASS sm90 kernels).
    min_compute_capability=(9, 0),
    max_compute_capability=None,
    cpu_needs_interpreter=False,
    packages=frozenset({"torch"}),
    dtypes=frozenset({torch.bfloat16}),  # the CUDA kernel takes bf16 operands only
    activations=ALL_ACTIVATIONS,  # applied in torch between the GEMMs
    gating=ALL_GATING,
    routing_methods=ALL_ROUTING,  # routing happens before; weights_on_input scales x rows
    expert_bias=True,  # gathered per pair and added in fp32
    quantizations=FULL_PRECISION_ONLY,  # torch._grouped_mm multiplies serving-dtype experts
    parallel_modes=frozenset(ParallelMode),  # TP shards / EP local ids: plain shard inputs
    lora=True,
    runs_without_lora=True,
    max_rank=None,  # fp32 torch matmuls: no rank limit
    max_slots=None,
    # Fully sharded LoRA needs the collectives between each shrink and expand; this
    # backend's per-(slot, expert) torch loop does not run them (forward raises if given a
    # LoRAComm), so it is refused.
    lora_add_inputs={
        LoRASharding.UNSHARDED: frozenset(AddInputs),
        LoRASharding.TP: frozenset(AddInputs),
    },
    # Operand strides must be multiples of 16 bytes: 8 bf16 elements for the rows of x
    # [N, H] and z [N, I_p] and of w13^T / w2^T (torch/_meta_registrations.py,
    # check_valid_strides).
    intermediate_align=8,
    hidden_align=8,
    max_experts=None,
    max_groups=1023,  # measured on the H200: torch._grouped_mm refuses 1024 or more groups
    # The LoRA path reads segment sizes on the host, and HF documents grouped_mm experts as
    # not capturable (shared/research/anchors.md, point 9).
    cuda_graph_safe=False,
    validated_on=VALIDATED_ON,
)


def _sort_pairs(topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (order [N] pairs sorted by expert, expert [N] sorted, offs [E_l] int32, local [N])."""
    flat = topk_ids.reshape(-1).long()
    local = (flat >= 0) & (flat < num_experts)
    key = torch.where(local, flat, num_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    offs = torch.cumsum(counts, 0).to(torch.int32)
    return order, key[order], offs, local[order]


def _lora_delta(rows: Tensor, a: Tensor, b: Tensor, key: Tensor, ranks: list[int]) -> Tensor:
    """B[a, e] @ (A[a, e] @ row) per row with key = a * E + e (-1 = none), over slot a's real
    rank ranks[a]; fp32 rank intermediate. rows [n, in]; a [L, E, R, in]; b [L, E, out, R];
    key [n]."""
    num_experts = a.shape[1]
    delta = torch.zeros(rows.shape[0], b.shape[2], dtype=torch.float32, device=rows.device)
    for k in torch.unique(key[key >= 0]).tolist():  # host sync: one segment per (slot, expert)
        slot, expert = divmod(k, num_experts)
        sel = key == k
        r = ranks[slot]
        inner = rows[sel].float() @ a[slot, expert, :r].float().t()
        delta[sel] = inner @ b[slot, expert, :, :r].float().t()
    return delta


def _w13_lora(
    shape: MoEShape, rows: Tensor, lora: LoRABank, key: Tensor, ranks: list[int]
) -> Tensor:
    """The w13 delta [n, S*I], gate and up placed in w13's row layout."""
    parts = [
        _lora_delta(rows, lora.w13_a[:, :, s], lora.w13_b[:, :, s], key, ranks)
        for s in range(shape.activation.width_factor)
    ]
    if len(parts) == 1:
        return parts[0]
    joined = rows.new_empty(rows.shape[0], 2 * parts[0].shape[1], dtype=torch.float32)
    for view, part in zip(split_gate_up(shape.activation, joined), parts):
        view.copy_(part)
    return joined


class GroupedMMBackend:
    name = "grouped_mm"
    capabilities = CAPABILITIES

    def forward(self, call: MoECall, experts: ExpertWeights, shape: MoEShape) -> Tensor:
        """y [T, H] in x's dtype; see Backend.forward for out / add_inputs. call.lora_comm
        must be None: fully sharded LoRA is refused by this backend's record."""
        if call.lora_comm is not None:
            raise InputError(
                "lora_comm",
                "a LoRAComm",
                "None: grouped_mm does not run fully sharded LoRA "
                "(use --moe-backend triton or reference, or drop --fully-sharded-loras)",
            )
        x, topk_ids, topk_weights = call.x, call.topk_ids, call.topk_weights
        lora = call.lora if call.has_lora else None
        num_experts, top_k = experts.w13.shape[0], topk_ids.shape[1]
        order, expert, offs, local = _sort_pairs(topk_ids, num_experts)
        token = order // top_k
        g = topk_weights.reshape(-1)[order].float().unsqueeze(1)
        rows = x[token]
        if call.weights_on_input:
            rows = (rows.float() * g).to(x.dtype)
        h = torch._grouped_mm(rows, experts.w13.transpose(1, 2), offs=offs).float()
        key = self._lora_key(call.token_slots, token, expert, local, num_experts, lora)
        if experts.b13 is not None:
            h += experts.b13[expert.clamp(max=num_experts - 1)].float()
        if lora is not None:
            ranks = lora.ranks.tolist()  # host sync, as the segments below
            h += _w13_lora(shape, rows, lora, key, ranks)
        z = apply_activation(
            shape.activation, h, alpha=shape.swiglu_alpha, limit=shape.swiglu_limit
        )
        o = torch._grouped_mm(z.to(x.dtype), experts.w2.transpose(1, 2), offs=offs).float()
        if experts.b2 is not None:
            o += experts.b2[expert.clamp(max=num_experts - 1)].float()
        if lora is not None:
            o += _lora_delta(z, lora.w2_a, lora.w2_b, key, ranks)
        o = o if call.weights_on_input else o * g
        o = torch.where(local.unsqueeze(1), o, 0.0)  # rows past offs[-1] are not computed
        y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        return write_output(y.index_add_(0, token, o).to(x.dtype), call.out, call.add_inputs)

    @staticmethod
    def _lora_key(
        token_slots: Tensor | None,
        token: Tensor,
        expert: Tensor,
        local: Tensor,
        num_experts: int,
        lora: LoRABank | None,
    ) -> Tensor:
        """slot * E + expert per sorted pair; -1 for no adapter or a non-local expert."""
        if lora is None or token_slots is None:
            return torch.full_like(token, -1)
        slot = token_slots.long()[token]
        return torch.where((slot >= 0) & local, slot * num_experts + expert, -1)


BACKEND = GroupedMMBackend()
