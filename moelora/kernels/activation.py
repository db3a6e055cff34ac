"""Expert activations as Triton device functions, fused into the gate/up GEMM epilogue.

Fusing saves a write and a read of h [P, S*I] in fp32; the epilogue has the gate and up
tiles of the same rows in registers, so the fused form costs no extra memory traffic.
ACT codes (constexpr) follow `Activation`; `act_code` maps the enum to them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..activations import Activation

ACT_CODES: dict[Activation, int] = {
    Activation.SILU: 0,
    Activation.GELU: 1,
    Activation.GELU_TANH: 2,
    Activation.SWIGLUOAI: 3,
    Activation.RELU2_NO_MUL: 4,
    Activation.SILU_NO_MUL: 5,
    Activation.GELU_NO_MUL: 6,
}


def act_code(kind: Activation) -> int:
    return ACT_CODES[kind]


@triton.jit
def _sigmoid(v):
    return 1.0 / (1.0 + tl.exp(-v))


@triton.jit
def _gelu_erf(v):
    return 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))


@triton.jit
def _gelu_tanh(v):
    # tanh(u) = 2 * sigmoid(2u) - 1: portable across Triton versions (no libdevice tanh).
    u = 0.7978845608028654 * (v + 0.044715 * v * v * v)
    return 0.5 * v * (1.0 + (2.0 * _sigmoid(2.0 * u) - 1.0))


@triton.jit
def apply_act(gate, up, ACT: tl.constexpr, alpha, limit):
    """z from fp32 tiles. Gated (ACT 0-3): gate and up; non-gated (4-6): `gate` is h."""
    if ACT == 0:
        z = gate * _sigmoid(gate) * up
    elif ACT == 1:
        z = _gelu_erf(gate) * up
    elif ACT == 2:
        z = _gelu_tanh(gate) * up
    elif ACT == 3:
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        z = (u + 1.0) * g * _sigmoid(alpha * g)
    elif ACT == 4:
        r = tl.maximum(gate, 0.0)
        z = r * r
    elif ACT == 5:
        z = gate * _sigmoid(gate)
    else:
        z = _gelu_erf(gate)
    return z
