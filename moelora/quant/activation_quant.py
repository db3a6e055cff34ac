"""The run-time activation quantization of the W8A8 formats, as the reference models it.

Each base GEMM input row (a token's x before gate/up, its activation output z before down)
is quantized to e4m3 per group of columns: FP8_BLOCK groups of the block's K side (128),
FP8_CHANNEL the whole row. A group's scale is fp32 amax / 448 and its values are
(v / scale) clamped to +-448, rounded to nearest even. The triton kernels do the same fp32
arithmetic in registers (kernels/fp8_tiles.py: quantize_rows). The LoRA branch never sees
this: it reads the unquantized row (vLLM #42007 fed it the quantized one).

Legend: N rows, K columns, G = ceil(K / group) groups per row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..quantization import FP8_E4M3_MAX, QuantConfig

MIN_SCALE = 1e-12  # an all-zero group keeps a finite scale (its values quantize to 0)


def group_scales(x: Tensor, group: int | None) -> Tensor:
    """x [N, K] -> fp32 scales [N, G] = each group's amax / 448 (group None: the whole row,
    G = 1). A last, partial group takes the columns left."""
    xf = x.float().abs()
    width = x.shape[1] if group is None else group
    pad = -x.shape[1] % width
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))  # zeros: no effect on an amax
    amax = xf.reshape(x.shape[0], xf.shape[1] // max(width, 1), width).amax(dim=2)
    return amax.clamp(min=MIN_SCALE) / FP8_E4M3_MAX


def _per_column(scales: Tensor, group: int | None, cols: int) -> Tensor:
    """scales [N, G] -> [N, K]: each column's group scale."""
    width = cols if group is None else group
    return scales.repeat_interleave(width, dim=1)[:, :cols]


def quantize_activations(x: Tensor, group: int | None) -> tuple[Tensor, Tensor]:
    """x [N, K] -> (e4m3 [N, K], fp32 scales [N, G]) with x ~= q * its group's scale."""
    scales = group_scales(x, group)
    full = _per_column(scales, group, x.shape[1])
    q = (x.float() / full).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scales


def base_gemm_input(quant: QuantConfig, x: Tensor) -> Tensor:
    """What a base GEMM of this format multiplies: x [N, K] fp32 itself, or (W8A8) its
    fp8 quantization per token and group, dequantized to fp32."""
    if not quant.method.quantizes_inputs:
        return x
    group = quant.activation_group
    q, scales = quantize_activations(x, group)
    return q.float() * _per_column(scales, group, x.shape[1])
