"""One kernel from the q / k / v projections to the attention's inputs at decode: per head an
optional RMSNorm (Qwen3's q_norm / k_norm), the rotary embedding, and k / v written into the
KV cache at each row's position; q comes back rotated, [T, Hq, D].

Each step rounds as transformers' eager code does in the activation dtype: the norm as
kernels/rms_norm.py, then q * cos and rotate_half(q) * sin each rounded, and their sum
(cos and sin in that dtype, as the model's rotary embedding returns them). One program per
(row, head) of q then k. Legend: T rows, Hq / Hk query / key-value heads, D head width,
N cache rows, M cache positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..tiling.geometry import next_pow2
from .output import as_stored


@triton.jit
def _rope_head(
    src_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    eps,
    head_dim,
    HAS_NORM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    dtype: tl.constexpr,
):
    """One head [D] of q or k: normed (optional), rotated; fp32 holding dtype values."""
    half = head_dim // 2
    offs = tl.arange(0, BLOCK_D)
    ok = offs < head_dim
    x = tl.load(src_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    # rotate_half: (-x[half:], x[:half]), read as a second load of the same head
    partner = tl.where(offs < half, offs + half, offs - half)
    xp = tl.load(src_ptr + partner, mask=ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        var = tl.sum(x * x, axis=0) / head_dim
        scale = tl.math.rsqrt(var + eps)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=ok, other=0.0).to(tl.float32)
        x = as_stored(w * as_stored(x * scale, dtype).to(tl.float32), dtype).to(tl.float32)
        xp = as_stored(wp * as_stored(xp * scale, dtype).to(tl.float32), dtype).to(tl.float32)
    rotated = tl.where(offs < half, -xp, xp)
    c = tl.load(cos_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    xc = as_stored(x * c, dtype).to(tl.float32)
    xs = as_stored(rotated * s, dtype).to(tl.float32)
    return as_stored(xc + xs, dtype)


@triton.jit
def _rope_cache_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    rows_ptr,
    pos_ptr,
    eps,
    head_dim,
    q_heads,
    stride_q,
    stride_k,
    stride_v,
    stride_cos,
    stride_qo_t,
    stride_qo_h,
    stride_c_n,
    stride_c_h,
    stride_c_m,
    stride_v_n,
    stride_v_h,
    stride_v_m,
    HAS_NORM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    head = tl.program_id(1)  # q heads first, then kv heads
    dtype = q_out_ptr.dtype.element_ty
    cos = cos_ptr + t * stride_cos
    sin = sin_ptr + t * stride_cos
    offs = tl.arange(0, BLOCK_D)
    ok = offs < head_dim
    if head < q_heads:
        out = _rope_head(q_ptr + t * stride_q + head * head_dim, qw_ptr, cos, sin, eps,
                         head_dim, HAS_NORM, BLOCK_D, dtype)  # fmt: skip
        tl.store(q_out_ptr + t * stride_qo_t + head * stride_qo_h + offs, out, mask=ok)
    else:
        kv = head - q_heads
        row = tl.load(rows_ptr + t)
        pos = tl.load(pos_ptr + t)
        out = _rope_head(k_ptr + t * stride_k + kv * head_dim, kw_ptr, cos, sin, eps,
                         head_dim, HAS_NORM, BLOCK_D, dtype)  # fmt: skip
        dst = k_cache_ptr + row * stride_c_n + kv * stride_c_h + pos * stride_c_m + offs
        tl.store(dst, out.to(k_cache_ptr.dtype.element_ty), mask=ok)
        v = tl.load(v_ptr + t * stride_v + kv * head_dim + offs, mask=ok, other=0.0)
        dst = v_cache_ptr + row * stride_v_n + kv * stride_v_h + pos * stride_v_m + offs
        tl.store(dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def rope_and_cache(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    rows: Tensor,
    positions: Tensor,
    q_norm: Tensor | None = None,
    k_norm: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """q [T, Hq*D], k / v [T, Hk*D], cos / sin [T, D] (the model's dtype), caches [N, Hk, M,
    D], rows / positions [T] long (where token t's k / v go), q_norm / k_norm [D] or None:
    returns q rotated [T, Hq, D]; k rotated and v written into the caches."""
    tokens, head_dim = q.shape[0], cos.shape[-1]
    q_heads, kv_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    q_out = torch.empty(tokens, q_heads, head_dim, dtype=q.dtype, device=q.device)
    has_norm = q_norm is not None
    if tokens:
        _rope_cache_kernel[(tokens, q_heads + kv_heads)](
            q, k, v, q_norm if has_norm else q, k_norm if has_norm else k, cos, sin, q_out,
            k_cache, v_cache, rows, positions, eps, head_dim, q_heads,
            q.stride(0), k.stride(0), v.stride(0), cos.stride(0),
            q_out.stride(0), q_out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            HAS_NORM=has_norm, BLOCK_D=next_pow2(head_dim), num_warps=1,
        )  # fmt: skip
    return q_out
