"""One kernel from the q / k / v projections to the attention's inputs: per head an optional
RMSNorm, the rotary embedding, and k / v written into the KV cache at each token's position;
q comes back rotated, [T, Hq, D]. The families' forms, as transformers writes them:

- Qwen3 / OLMoE / Mixtral / gpt-oss (rope "halves", norm "before" with its weight or none):
  the norm as kernels/rms_norm.py (the normed row rounded, then times the weight, rounded;
  Qwen3.5's zero-centered norms with round_normed False: (1 + weight) in fp32 times the
  fp32 normed row, one rounding), then rotate_half over the first R of each head's D
  (R = cos.shape[-1]; Qwen3.5's partial rotary: the rest kept): q * cos and rotate_half(q)
  * sin each rounded, then their sum (cos / sin in the activation dtype, as the model's
  rotary embedding returns them);
- Llama 4 (rope "pairs", norm "after"): interleaved pairs rotated as complex numbers in
  fp32 (cos / sin [T, D / 2]: the frequencies' real and imaginary parts), rounded once, then
  the weightless RMSNorm of the rounded head in fp32, rounded (Llama4TextL2Norm); its NoPE
  layers: rope "none", q times each token's attention temperature (q_scale, fp32: the
  rounded q times it in fp32, rounded);
- DeepSeek's latent attention (no v: the cache's latent is written apart): its rotary parts
  of q and of the shared key, rope "halves", "complex pairs" as Llama 4's (V2), or
  "deinterleaved" (V3's rope_interleave: the pairs' first elements then their second ones,
  then rotate_half as "halves", transformers' apply_rotary_pos_emb_interleave).

q may hold more than its heads (Qwen3.5's q_proj gives each head's q then its output gate:
q_head_stride 2D; the gate is not read). One program per (token, head) of q then k.
Legend: T tokens, Hq / Hk query / key-value heads, D head width, R rotary width, N cache
rows (blocks), M positions per cache row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..tiling.geometry import next_pow2
from .output import as_stored

NORMS = {"none": 0, "before": 1, "after": 2}
ROPES = {"none": 0, "halves": 1, "pairs": 2, "deinterleaved": 3}


@triton.jit
def _rope_head(
    src_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    eps,
    head_dim,
    rot_dim,
    NORM: tl.constexpr,
    ROUND_NORMED: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    dtype: tl.constexpr,
):
    """One head [D] of q or k: normed and rotated as the module docstring says; dtype values."""
    offs = tl.arange(0, BLOCK_D)
    ok = offs < head_dim
    half = rot_dim // 2
    if ROPE == 1 or ROPE == 3:  # rotate_half over the first rot_dim: (-x[half:R], x[:half])
        partner = tl.where(offs < half, offs + half, tl.where(offs < rot_dim, offs - half, offs))
    elif ROPE == 2:  # complex pairs (x0, x1), (x2, x3), ...
        partner = offs ^ 1
    else:
        partner = offs
    at, at_partner = offs, partner
    if ROPE == 3:  # element j of the deinterleaved head: x[2j] (j < half), x[2(j - half) + 1]
        at = tl.where(offs < half, 2 * offs, 2 * (offs - half) + 1)
        at_partner = tl.where(partner < half, 2 * partner, 2 * (partner - half) + 1)
    x = tl.load(src_ptr + at, mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(src_ptr + at_partner, mask=ok, other=0.0).to(tl.float32)  # a second load
    if NORM == 1:
        scale = tl.math.rsqrt(tl.sum(x * x, axis=0) / head_dim + eps)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=ok, other=0.0).to(tl.float32)
        if ROUND_NORMED:
            x = as_stored(w * as_stored(x * scale, dtype).to(tl.float32), dtype).to(tl.float32)
            xp = as_stored(wp * as_stored(xp * scale, dtype).to(tl.float32), dtype).to(tl.float32)
        else:
            x = as_stored(w * (x * scale), dtype).to(tl.float32)
            xp = as_stored(wp * (xp * scale), dtype).to(tl.float32)
    if ROPE == 1 or ROPE == 3:
        turned = offs < rot_dim
        rotated = tl.where(offs < half, -xp, xp)
        c = tl.load(cos_ptr + offs, mask=turned, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + offs, mask=turned, other=0.0).to(tl.float32)
        xc = as_stored(x * c, dtype).to(tl.float32)
        xs = as_stored(rotated * s, dtype).to(tl.float32)
        x = tl.where(turned, as_stored(xc + xs, dtype).to(tl.float32), x)
    elif ROPE == 2:
        rotated = tl.where(offs % 2 == 0, -xp, xp)
        c = tl.load(cos_ptr + offs // 2, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + offs // 2, mask=ok, other=0.0).to(tl.float32)
        x = as_stored(x * c + rotated * s, dtype).to(tl.float32)
    if NORM == 2:
        x = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / head_dim + eps)
    return as_stored(x, dtype)


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
    q_scale_ptr,
    eps,
    head_dim,
    rot_dim,
    q_heads,
    q_head_stride,
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
    NORM: tl.constexpr,
    ROUND_NORMED: tl.constexpr,
    ROPE: tl.constexpr,
    HAS_Q_SCALE: tl.constexpr,
    HAS_V: tl.constexpr,
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
        out = _rope_head(q_ptr + t * stride_q + head * q_head_stride, qw_ptr, cos, sin, eps,
                         head_dim, rot_dim, NORM, ROUND_NORMED, ROPE, BLOCK_D, dtype)  # fmt: skip
        if HAS_Q_SCALE:
            out = as_stored(out.to(tl.float32) * tl.load(q_scale_ptr + t), dtype)
        tl.store(q_out_ptr + t * stride_qo_t + head * stride_qo_h + offs, out, mask=ok)
    else:
        kv = head - q_heads
        row = tl.load(rows_ptr + t)
        pos = tl.load(pos_ptr + t)
        out = _rope_head(k_ptr + t * stride_k + kv * head_dim, kw_ptr, cos, sin, eps,
                         head_dim, rot_dim, NORM, ROUND_NORMED, ROPE, BLOCK_D, dtype)  # fmt: skip
        dst = k_cache_ptr + row * stride_c_n + kv * stride_c_h + pos * stride_c_m + offs
        tl.store(dst, out.to(k_cache_ptr.dtype.element_ty), mask=ok)
        if HAS_V:
            v = tl.load(v_ptr + t * stride_v + kv * head_dim + offs, mask=ok, other=0.0)
            dst = v_cache_ptr + row * stride_v_n + kv * stride_v_h + pos * stride_v_m + offs
            tl.store(dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def rope_and_cache(
    q: Tensor,
    k: Tensor,
    v: Tensor | None,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor | None,
    rows: Tensor,
    positions: Tensor,
    q_norm: Tensor | None = None,
    k_norm: Tensor | None = None,
    eps: float = 1e-6,
    *,
    norm: str | None = None,
    round_normed: bool = True,
    rope: str = "halves",
    head_dim: int | None = None,
    q_head_stride: int | None = None,
    q_scale: Tensor | None = None,
    q_heads: int | None = None,
) -> Tensor:
    """q [T, Hq x q_head_stride], k / v [T, Hk x D], cos / sin [T, R] (rope "halves": the
    model's dtype, R <= D rotated) or [T, D / 2] (rope "pairs": fp32), caches [N, Hk, M, D],
    rows / positions [T] long (where token t's k / v go), q_norm / k_norm [D] the norm's
    weights (norm "before"; Qwen3.5's as 1 + weight in fp32 with round_normed False), norm
    "after": the weightless norm after rotary (default: "before" with weights, else "none");
    head_dim D (default cos.shape[-1]), q_head_stride (default D), q_scale [T] fp32: each
    token's factor on q, last (Llama 4's attention temperature), q_heads Hq (default q's
    width / q_head_stride; DeepSeek's rotary parts: q a view from the first one on). v /
    v_cache None: no values written. Returns q [T, Hq, D] normed, rotated (and scaled); k
    normed, rotated and v written into the caches."""
    head_dim = cos.shape[-1] if head_dim is None else head_dim
    q_head_stride = head_dim if q_head_stride is None else q_head_stride
    norm = ("none" if q_norm is None else "before") if norm is None else norm
    if norm not in NORMS or rope not in ROPES or (norm == "before") != (q_norm is not None):
        raise ValueError(f"rope_and_cache: norm {norm!r} (q_norm given: {q_norm is not None})"
                         f", rope {rope!r}; expected norm in {list(NORMS)} with weights exactly "
                         f"for 'before', rope in {list(ROPES)}")  # fmt: skip
    rot_dim = {"halves": cos.shape[-1], "deinterleaved": cos.shape[-1], "pairs": 2 * cos.shape[-1],
               "none": 0}[rope]  # fmt: skip
    whole = rope in ("pairs", "deinterleaved")
    if rot_dim > head_dim or rot_dim % 2 or (whole and rot_dim != head_dim):
        raise ValueError(f"rope_and_cache: cos {tuple(cos.shape)} for rope {rope!r} over heads "
                         f"of {head_dim}; expected [T, R <= D] (halves, R even), [T, D] "
                         "(deinterleaved) or [T, D / 2] (pairs)")  # fmt: skip
    cos, sin = cos.contiguous(), sin.contiguous()  # (a complex tensor's .real is strided)
    tokens = q.shape[0]
    q_heads = q.shape[1] // q_head_stride if q_heads is None else q_heads
    kv_heads = k.shape[1] // head_dim
    has_v = v is not None
    v, v_cache = (v, v_cache) if has_v else (k, k_cache)  # (not read without values)
    q_out = torch.empty(tokens, q_heads, head_dim, dtype=q.dtype, device=q.device)
    if tokens:
        _rope_cache_kernel[(tokens, q_heads + kv_heads)](
            q, k, v, q if q_norm is None else q_norm, k if k_norm is None else k_norm, cos, sin,
            q_out, k_cache, v_cache, rows, positions, q if q_scale is None else q_scale, eps,
            head_dim, rot_dim, q_heads,
            q_head_stride, q.stride(0), k.stride(0), v.stride(0), cos.stride(0),
            q_out.stride(0), q_out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            NORM=NORMS[norm], ROUND_NORMED=round_normed, ROPE=ROPES[rope],
            HAS_Q_SCALE=q_scale is not None, HAS_V=has_v, BLOCK_D=next_pow2(head_dim),
            num_warps=1,
        )  # fmt: skip
    return q_out
