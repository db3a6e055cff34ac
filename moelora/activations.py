"""Activation functions of MoE experts: the `Activation` enum and its torch definitions.

Gated activations take h [N, 2*I] (gate rows first, or interleaved for swigluoai) and
return z [N, I]; non-gated ones take h [N, I] and return z [N, I].
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F


class Activation(str, enum.Enum):
    """Expert activation. Gated ones combine a gate and an up projection."""

    SILU = "silu"  # gated: silu(gate) * up (SwiGLU)
    GELU = "gelu"  # gated: gelu_erf(gate) * up (GeGLU)
    GELU_TANH = "gelu_tanh"  # gated: gelu_tanh(gate) * up
    SWIGLUOAI = "swigluoai"  # gated, gpt-oss: interleaved rows, clamped, (up + 1) * gate * sigmoid(a * gate)
    RELU2_NO_MUL = "relu2_no_mul"  # non-gated: relu(h) ** 2 (NemotronH)
    SILU_NO_MUL = "silu_no_mul"  # non-gated: silu(h)
    GELU_NO_MUL = "gelu_no_mul"  # non-gated: gelu_erf(h)

    @property
    def is_gated(self) -> bool:
        return self in _GATED

    @property
    def width_factor(self) -> int:
        """S in SPEC.md: rows of w13 per intermediate unit (2 gated, 1 non-gated)."""
        return 2 if self.is_gated else 1


_GATED = frozenset({Activation.SILU, Activation.GELU, Activation.GELU_TANH, Activation.SWIGLUOAI})

# gpt-oss constants (transformers GptOssExperts: alpha = 1.702, limit = swiglu_limit = 7.0).
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


def _unary(kind: Activation, v: torch.Tensor) -> torch.Tensor:
    if kind in (Activation.SILU, Activation.SILU_NO_MUL):
        return F.silu(v)
    if kind in (Activation.GELU, Activation.GELU_NO_MUL):
        return F.gelu(v)
    if kind is Activation.GELU_TANH:
        return F.gelu(v, approximate="tanh")
    if kind is Activation.RELU2_NO_MUL:
        return torch.square(F.relu(v))
    raise ValueError(f"activation {kind!r} has no unary form")


def split_gate_up(kind: Activation, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split h [N, 2*I] into (gate [N, I], up [N, I]) by the row layout of `kind`."""
    if kind is Activation.SWIGLUOAI:
        return h[..., 0::2], h[..., 1::2]
    half = h.shape[-1] // 2
    return h[..., :half], h[..., half:]


def apply_activation(
    kind: Activation,
    h: torch.Tensor,
    *,
    alpha: float = SWIGLUOAI_ALPHA,
    limit: float = SWIGLUOAI_LIMIT,
) -> torch.Tensor:
    """z = act(h). h [N, S*I] -> z [N, I]; computed in h's dtype (callers pass fp32)."""
    if not kind.is_gated:
        return _unary(kind, h)
    gate, up = split_gate_up(kind, h)
    if kind is Activation.SWIGLUOAI:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * gate * torch.sigmoid(alpha * gate)
    return _unary(kind, gate) * up
