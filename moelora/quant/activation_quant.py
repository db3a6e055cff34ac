"""The run-time activation quantization of the W8A8 formats, as the reference models it.

Each base GEMM input row (a token's x before gate/up, its activation output z before down)
is quantized to e4m3 with its own scale amax / 448 and multiplied back. The LoRA branch
never sees this: it reads the unquantized row (vLLM #42007 fed it the quantized one).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .formats import FP8_E4M3_MAX, Quantization

MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale (its values quantize to 0)


def per_token_scale(x: Tensor) -> Tensor:
    """x [N, K] -> fp32 scale [N, 1] = amax over the row / 448."""
    return x.float().abs().amax(dim=1, keepdim=True).clamp(min=MIN_SCALE) / FP8_E4M3_MAX


def quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [N, K] -> (e4m3 [N, K], fp32 scale [N, 1]) with x ~= q * scale."""
    scale = per_token_scale(x)
    q = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def base_gemm_input(method: Quantization, x: Tensor) -> Tensor:
    """What a base GEMM of this format multiplies: x [N, K] fp32 itself, or (W8A8) its
    per-token fp8 quantization, dequantized to fp32."""
    if not method.quantizes_inputs:
        return x
    q, scale = quantize_per_token(x)
    return q.float() * scale
