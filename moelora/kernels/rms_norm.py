"""RMSNorm with the residual add before it, one row per program: the decode step's norms.

    s = x + residual                       (rounded to x's dtype: transformers adds in it)
    y = w * round(s * rsqrt(mean(s^2) + eps))

with transformers' RMSNorm's roundings (the normalized row in fp32, rounded to the input's
dtype, then times the weight, one rounding; only the mean's summation order differs); with
round_normed False, gpt-oss's: the weight times the fp32 normalized row, rounded once. With
residual None, s = x. The sum s is written to residual_out (the next
norm's residual). Legend: T rows, H hidden.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..tiling.geometry import next_pow2
from .output import as_stored


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    sum_ptr,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_y,
    stride_s,
    HAS_RES: tl.constexpr,
    ROUND_NORMED: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < hidden
    dtype = y_ptr.dtype.element_ty
    s = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        s = as_stored(s + r, dtype).to(tl.float32)
        tl.store(sum_ptr + row * stride_s + offs, s.to(dtype), mask=ok)
    var = tl.sum(s * s, axis=0) / hidden
    normed = s * tl.math.rsqrt(var + eps)
    if ROUND_NORMED:
        normed = as_stored(normed, dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, as_stored(w * normed, dtype), mask=ok)


def add_rms_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, round_normed: bool = True
) -> tuple[Tensor, Tensor]:
    """(y, s) for x [T, H] and residual [T, H] (or None): y = RMSNorm(s) * weight, s = x +
    residual (x itself without one). Rows are the leading dims flattened. round_normed:
    the normalized row rounded to x's dtype before the weight (Llama's, Qwen's); False:
    not (gpt-oss's)."""
    hidden = x.shape[-1]
    flat = x.reshape(-1, hidden)
    y = torch.empty_like(flat)
    if residual is None:
        s, res = flat, flat
    else:
        res = residual.reshape(-1, hidden)
        s = torch.empty_like(flat)
    if flat.shape[0]:
        _add_rms_norm_kernel[(flat.shape[0],)](
            flat, res, weight, y, s, hidden, eps,
            flat.stride(0), res.stride(0), y.stride(0), s.stride(0),
            HAS_RES=residual is not None, ROUND_NORMED=round_normed, BLOCK_H=next_pow2(hidden),
            num_warps=4 if hidden <= 4096 else 8,
        )  # fmt: skip
    return y.view(x.shape), s.view(x.shape)
