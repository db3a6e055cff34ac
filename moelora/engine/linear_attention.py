"""Qwen3.5-MoE's linear-attention layers (Gated DeltaNet) on the runner, as transformers'
Qwen3_5MoeGatedDeltaNet computes them, with each row's state kept per block-table row.

A linear-attention layer keeps no keys and values: each row carries a recurrent state
S [Hv, Dk, Dv] (fp32, as transformers keeps it) and the last K - 1 inputs of its causal
depthwise convolution (the projections' dtype). Per token: the projections in_proj_qkv /
z / b / a of the normed row (the runner's one GEMM with their LoRA); the causal conv over
the last K inputs then its activation (silu); q, k L2-normed and q scaled by Dk^-1/2;
beta = sigmoid(b), g = -exp(A_log) x softplus(a + dt_bias); S <- S exp(g); S <- S + k (beta (v - S^T k))^T;
out = S^T q; RMSNorm of out gated by silu(z); out_proj. A decode step runs that update for
every row at once (gathered from and scattered back to its state row: a CUDA graph replays
it), in kernels/gated_delta.py's two kernels (conv, gates and state update; the gated norm)
where the layer's conv has no bias and silu, else in torch ops; a prompt (or a chunk of one, starting from the state its row holds) runs the chunked
form transformers' prefill uses (chunks of 64 tokens, the UT transform), one sequence at a
time; sequences of one token (decodes beside prompt chunks) take the per-token update
together. A prompt starting at position 0 starts from zero state.

The update is not idempotent (a KV write is): a step that fails part-way leaves states
advanced, so the engine recomputes a failed row from its first token (engine.py).
Legend: T tokens, R state rows (the block table's), C = 2 Hk Dk + Hv Dv conv channels,
K conv width, Hk / Hv key / value heads, Dk / Dv their widths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.gated_delta import gated_delta_step, gated_rms_norm
from .norm_eps import norm_eps

CHUNK = 64  # transformers' prefill chunk (torch_chunk_gated_delta_rule's default)


@dataclass
class LinearState:
    """One linear-attention layer's state of every row."""

    conv: Tensor  # [R, C, K - 1] the last K - 1 conv inputs (zeros before the first token)
    recurrent: Tensor  # [R, Hv, Dk, Dv] fp32


def is_linear(layer: nn.Module) -> bool:
    """A decoder layer whose token mixer is linear attention (Qwen3.5's linear_attn)."""
    return hasattr(layer, "linear_attn")


def allocate(model: nn.Module, rows: int, device, dtype) -> dict[int, LinearState]:
    """Zero states of `rows` rows for each linear-attention layer, by layer index."""
    states = {}
    for index, layer in enumerate(model.model.layers):
        if not is_linear(layer):
            continue
        mixer = layer.linear_attn
        channels, width = mixer.conv_dim, mixer.conv_kernel_size
        states[index] = LinearState(
            torch.zeros(rows, channels, width - 1, dtype=dtype, device=device),
            torch.zeros(
                rows,
                mixer.num_v_heads,
                mixer.head_k_dim,
                mixer.head_v_dim,
                dtype=torch.float32,
                device=device,
            ),
        )
    return states


def state_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of one row's states over every linear-attention layer."""
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for layer in model.model.layers:
        if is_linear(layer):
            m = layer.linear_attn
            total += m.conv_dim * (m.conv_kernel_size - 1) * size
            total += m.num_v_heads * m.head_k_dim * m.head_v_dim * 4
    return total


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _heads(mixer: nn.Module, mixed: Tensor):
    """q, k [T, Hv, Dk] (L2-normed, q scaled; key heads repeated per value head), v [T, Hv,
    Dv], all fp32, from the conv's output [T, C]."""
    tokens = mixed.shape[0]
    q, k, v = torch.split(mixed, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    q = q.reshape(tokens, -1, mixer.head_k_dim).float()
    k = k.reshape(tokens, -1, mixer.head_k_dim).float()
    v = v.reshape(tokens, -1, mixer.head_v_dim).float()
    repeat = mixer.num_v_heads // mixer.num_k_heads
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    q, k = _l2norm(q), _l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v


def _gates(mixer: nn.Module, b: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """beta, g [T, Hv] fp32."""
    beta = b.sigmoid().float()
    g = -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)
    return beta, g


def _conv(mixer: nn.Module, window: Tensor, length: int) -> Tensor:
    """The activation of the causal conv's last `length` outputs over window [N, C, K - 1 + length]
    (the K - 1 inputs before them first): [N, length, C] in the window's dtype."""
    from transformers.activations import ACT2FN  # (transformers loads with the model)

    weight = mixer.conv1d.weight
    out = F.conv1d(window.to(weight.dtype), weight, mixer.conv1d.bias, groups=window.shape[1])
    return ACT2FN[mixer.activation](out[:, :, -length:]).to(window.dtype).transpose(1, 2)


def _output(mixer: nn.Module, core: Tensor, z: Tensor) -> Tensor:
    """The gated RMSNorm of core [T, Hv, Dv] (fp32) by z [T, Hv x Dv], in z's dtype, [T,
    Hv x Dv] (out_proj's input)."""
    dtype, norm = z.dtype, mixer.norm
    x = core.to(dtype).float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm_eps(norm))
    x = norm.weight * x.to(dtype)
    x = x * F.silu(z.view_as(core).float())
    return x.to(dtype).reshape(z.shape)


def fusable(mixer: nn.Module) -> bool:
    """The layer's decode runs kernels/gated_delta.py (a conv without bias, silu)."""
    return mixer.conv1d.bias is None and mixer.activation == "silu"


def decode(mixer: nn.Module, state: LinearState, rows: Tensor, qkv: Tensor, z: Tensor,
           b: Tensor, a: Tensor, fused: bool = True) -> Tensor:  # fmt: skip
    """One token of each row [T] (its state row): the projections qkv [T, C], z, b, a; the
    states updated; out_proj's input [T, Hv x Dv]. fused: in kernels/gated_delta.py's two
    kernels where the layer allows (fusable), else torch ops."""
    if fused and fusable(mixer):
        core = _step(mixer, state, rows, qkv, b, a, fused)
        return gated_rms_norm(core, z, mixer.norm.weight, norm_eps(mixer.norm))
    return _output(mixer, _step(mixer, state, rows, qkv, b, a), z)


@dataclass(frozen=True)
class Packed:
    """A prefill's packed sequences as every linear-attention layer reads them (pack(): once
    per forward)."""

    sequences: list[tuple[int, int, int, int]]  # (first token, length, state row, first
    # position) each
    ones_at: Tensor | None  # the tokens of one-token sequences going on from a state (decodes
    # beside prompt chunks: the per-token update, together), and their state rows
    ones_rows: Tensor | None


def pack(sequences: list[tuple[int, int, int, int]], device) -> Packed:
    ones = [s for s in sequences if s[1] == 1 and s[3] > 0]
    if not ones:
        return Packed(sequences, None, None)
    at = torch.tensor([[s[0] for s in ones], [s[2] for s in ones]]).to(device)
    return Packed(sequences, at[0], at[1])


def prefill(mixer: nn.Module, state: LinearState, packed: Packed, qkv: Tensor, z: Tensor,
            b: Tensor, a: Tensor, fused: bool = True) -> Tensor:  # fmt: skip
    """The packed sequences' tokens' projections qkv [T, C], z, b, a: each sequence from
    its row's state (zero at position 0), the states updated; out_proj's input [T, Hv x
    Dv]."""
    out = torch.empty(qkv.shape[0], mixer.num_v_heads, mixer.head_v_dim, device=qkv.device)
    at, rows = packed.ones_at, packed.ones_rows
    if at is not None:
        out[at] = _step(mixer, state, rows, qkv[at], b[at], a[at], fused and fusable(mixer))
    for start, length, row, pos0 in packed.sequences:
        if length == 1 and pos0 > 0:
            continue
        end = start + length
        before = state.conv[row] if pos0 > 0 else torch.zeros_like(state.conv[row])
        window = torch.cat([before, qkv[start:end].t()], dim=-1)[None]
        state.conv[row] = window[0, :, -(state.conv.shape[-1]) :]
        mixed = _conv(mixer, window, length)[0]
        q, k, v = _heads(mixer, mixed)
        beta, g = _gates(mixer, b[start:end], a[start:end])
        initial = state.recurrent[row] if pos0 > 0 else torch.zeros_like(state.recurrent[row])
        out[start:end], state.recurrent[row] = _chunked(q, k, v, g, beta, initial)
    return _output(mixer, out, z)


def _step(mixer, state: LinearState, rows: Tensor, qkv, b, a, fused: bool = False) -> Tensor:
    """The per-token update of rows [T] (one token each), their states advanced: core [T,
    Hv, Dv] fp32 (fused: kernels/gated_delta.py's step)."""
    window = torch.cat([state.conv[rows], qkv[:, :, None]], dim=-1)  # [T, C, K]
    state.conv[rows] = window[:, :, 1:]
    if fused:
        return gated_delta_step(window, mixer.conv1d.weight, b, a, mixer.A_log, mixer.dt_bias,
                                state.recurrent, rows, mixer.num_k_heads)  # fmt: skip
    q, k, v = _heads(mixer, _conv(mixer, window, 1)[:, 0])
    beta, g = _gates(mixer, b, a)
    s = state.recurrent[rows] * g.exp()[..., None, None]
    delta = (v - (s * k[..., None]).sum(dim=-2)) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    state.recurrent[rows] = s
    return (s * q[..., None]).sum(dim=-2)


def _chunked(q, k, v, g, beta, state):
    """The gated delta rule over one sequence, q / k [T, Hv, Dk], v [T, Hv, Dv], g / beta
    [T, Hv] (fp32), from state [Hv, Dk, Dv], in chunks of CHUNK tokens (the UT transform):
    (out [T, Hv, Dv], the final state)."""
    length = q.shape[0]
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)) for t in (q, k, v))  # [Hv, T', D]
    beta, g = (F.pad(t.transpose(0, 1), (0, pad)) for t in (beta, g))  # [Hv, T']
    heads = q.shape[0]
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(heads, -1, CHUNK, t.shape[-1])
                            for t in (q, k, k_beta, v_beta))  # fmt: skip
    decay = g.reshape(heads, -1, CHUNK).cumsum(dim=-1)  # [Hv, N, CHUNK]
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf"))
    pairwise = pairwise.exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    keys_decayed = torch.linalg.solve_triangular(
        system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True
    )
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.zeros_like(values)
    s = state.to(values.dtype)  # (fp32, as transformers computes it)
    for i in range(q.shape[1]):
        v_new = values[:, i] - keys_decayed[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, -1, out.shape[-1])[:, :length].transpose(0, 1)
    return out, s
