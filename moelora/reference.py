"""The one reference computation of SPEC.md: slow, obvious, fp32.

Every test, benchmark, the CLI and the `reference` backend call it: `reference_forward` on a
per-call record (call.py), or `moe_lora_reference` with the record's fields spelled out.
"""

from __future__ import annotations

import torch

from .activations import apply_activation, split_gate_up
from .call import MoECall
from .comm import LoRAComm
from .config import MoEShape
from .quant.activation_quant import base_gemm_input
from .weights import ExpertWeights, LoRABank


def _join_gate_up(shape: MoEShape, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Inverse of split_gate_up: (gate [N, I], up [N, I]) -> h [N, 2I] in w13's row layout."""
    h = torch.empty(gate.shape[0], 2 * gate.shape[1], dtype=gate.dtype, device=gate.device)
    g_view, u_view = split_gate_up(shape.activation, h)
    g_view.copy_(gate)
    u_view.copy_(up)
    return h


def _held(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """t (fp32) as a LoRA branch held in `dtype` holds it: rounded to it (None: as is)."""
    return t if dtype is None else t.to(dtype).float()


def _w13_delta(
    shape: MoEShape,
    x: torch.Tensor,
    lora: LoRABank,
    slot: int,
    rank: int,
    expert: int,
    comm: LoRAComm | None,
    held: torch.dtype | None,
) -> torch.Tensor:
    """The gate/up delta of one (slot, expert) over its real rank `rank` (the factors'
    columns past it are not the adapter's); `held`: the intermediate rounded to it."""
    parts = []
    for s in range(shape.activation.width_factor):
        u = x @ lora.w13_a[slot, expert, s].float().t()  # [N, R] (R/tp when fully sharded)
        if comm is not None:
            u = comm.gather_rank(u)
        u = _held(u, held)
        parts.append(u[:, :rank] @ lora.w13_b[slot, expert, s, :, :rank].float().t())
    return parts[0] if len(parts) == 1 else _join_gate_up(shape, parts[0], parts[1])


def _w2_delta(
    z: torch.Tensor,
    lora: LoRABank,
    slot: int,
    rank: int,
    expert: int,
    o: torch.Tensor,
    comm: LoRAComm | None,
    held: torch.dtype | None,
) -> torch.Tensor:
    """o [N, H] plus the down delta over the real rank; fully sharded: B2 holds this process's
    H slice only. `held`: z and the intermediate rounded to it."""
    v = _held(z, held) @ lora.w2_a[slot, expert, :rank].float().t()  # [N, r]; partial over I
    b = lora.w2_b[slot, expert, :, :rank].float()
    if comm is None:
        return o + _held(v, held) @ b.t()
    delta = _held(comm.reduce_rank(v), held) @ b.t()  # [N, H/tp]
    o = o.clone()
    o[:, comm.hidden_offset : comm.hidden_offset + delta.shape[1]] += delta
    return o


@torch.no_grad()
def reference_forward(
    call: MoECall,
    experts: ExpertWeights,
    shape: MoEShape,
    *,
    lora_held: torch.dtype | None = None,
) -> torch.Tensor:
    """y [T, H] in x's dtype for one per-call record (call.py).

    Expert ids outside [0, E) contribute nothing (expert parallel); tokens with slot -1 (or
    no slots at all) run the base model. call.weights_on_input: Llama-4 routing, the weight
    scales the expert input, not its output. call.lora_comm: fully sharded LoRA only (the
    bank holds this process's shards; see LoRAComm). experts.quantization: an FP8 format's
    base GEMMs multiply inputs quantized per token and group (quant/activation_quant.py)
    while the LoRA branch reads them unquantized. The (expert, slot) groups are visited in the same
    order on every process of the TP group, so the collectives match up. lora_held: the LoRA
    branch held in that dtype as a 16-bit HF + PEFT forward holds it (lora_B(lora_A(z)) on
    z as stored, each rank intermediate rounded before B; the triton backend's
    expand_one_dot); None: exact.
    """
    x, topk_ids, topk_weights = call.x, call.topk_ids, call.topk_weights
    lora = call.lora if call.has_lora else None
    lora_comm, weights_on_input = call.lora_comm, call.weights_on_input
    tokens = x.shape[0]
    xf = x.float()
    y = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)
    slots = (
        call.token_slots
        if lora is not None
        else torch.full((tokens,), -1, dtype=torch.int32, device=x.device)
    )
    ranks = [] if lora is None else lora.ranks.tolist()  # each slot's real rank
    for expert in range(experts.w13.shape[0]):
        tok, j = torch.nonzero(topk_ids == expert, as_tuple=True)
        if tok.numel() == 0:
            continue
        g = topk_weights[tok, j].float().unsqueeze(1)
        xe = xf[tok] * g if weights_on_input else xf[tok]
        # the base GEMMs see the format's quantized input; the LoRA deltas see xe and z as is
        h = base_gemm_input(experts.quantization, xe) @ experts.w13[expert].float().t()
        if experts.b13 is not None:
            h = h + experts.b13[expert].float()
        tok_slots = slots[tok]
        active = [] if lora is None else sorted(set(tok_slots[tok_slots >= 0].tolist()))
        for slot in active:
            rows = tok_slots == slot
            h[rows] += _w13_delta(
                shape, xe[rows], lora, slot, ranks[slot], expert, lora_comm, lora_held
            )
        z = apply_activation(
            shape.activation, h, alpha=shape.swiglu_alpha, limit=shape.swiglu_limit
        )
        # W8A8 quantizes z as the kernels (and transformers) hold it: in the serving dtype
        stored = z.to(x.dtype).float() if experts.quantization.method.quantizes_inputs else z
        o = base_gemm_input(experts.quantization, stored) @ experts.w2[expert].float().t()
        if experts.b2 is not None:
            o = o + experts.b2[expert].float()
        for slot in active:
            rows = tok_slots == slot
            o[rows] = _w2_delta(
                z[rows], lora, slot, ranks[slot], expert, o[rows], lora_comm, lora_held
            )
        y.index_add_(0, tok, o if weights_on_input else o * g)
    return y.to(x.dtype)


def moe_lora_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    token_slots: torch.Tensor | None,
    experts: ExpertWeights,
    lora: LoRABank | None,
    shape: MoEShape,
    *,
    weights_on_input: bool = False,
    lora_comm: LoRAComm | None = None,
    lora_held: torch.dtype | None = None,
) -> torch.Tensor:
    """reference_forward with the record's fields spelled out (the public form tests,
    benchmarks and the CLI call): x [T, H]; topk_ids [T, K]; topk_weights [T, K] fp32;
    token_slots [T] int32 (-1 = base model) or None."""
    call = MoECall(x, topk_ids, topk_weights, token_slots, lora, weights_on_input, lora_comm)
    return reference_forward(call, experts, shape, lora_held=lora_held)
