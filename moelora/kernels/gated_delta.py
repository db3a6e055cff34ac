"""One decode token of a Gated DeltaNet layer (Qwen3.5's linear attention) per row, in two
launches instead of some forty small torch ops.

gated_delta_step: one program per (row, value head, block of BLOCK_V value columns). It
reads the row's conv window (the K - 1 inputs before the token and the token's projection:
window [T, C, K]) for its q, k (its key head's) and v channels, runs the depthwise causal
conv (fp32 sums, rounded to the window's dtype, then silu rounded again: transformers'
conv1d and activation in that dtype), L2-normalizes q and k in fp32 (q also scaled by
Dk^-1/2), forms beta = sigmoid(b) (rounded to b's dtype) and g = -exp(A_log) softplus(a +
dt_bias), and updates its [Dk, BLOCK_V] tile of the row's fp32 state in place: S <- S e^g,
S <- S + k (beta (v - S^T k))^T, core = S^T q. Each tile belongs to one program (rows are
distinct; padding rows of a graphed step share the spare row, whose state is never read
for a real row). The conv state is shifted by the caller (it spans channels that several
programs read).

gated_rms_norm: one program per (row, value head): transformers' Qwen3_5MoeRMSNormGated
on core [T, Hv, Dv] (fp32) with gate z: the row rounded to z's dtype, normalized in fp32,
rounded, times the weight (a product in z's dtype), times silu(z) in fp32, rounded.
Legend: T rows, C conv channels (2 Hk Dk + Hv Dv), K conv width, Hk / Hv key / value
heads, Dk / Dv their widths, R state rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..tiling.geometry import next_pow2
from .output import as_stored

BLOCK_V = 32  # value columns per program: a [Dk, 32] fp32 state tile; reasoned, not tuned


@triton.jit
def _conv_silu(window_ptr, stride_c, ch, ok, w_ptr, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """silu(conv) of channels ch [N] over their window rows (K inputs each), in fp32, each
    of the two results rounded to the window's dtype as transformers' ops round them."""
    offs = tl.arange(0, BLOCK_K)
    k_ok = offs < K
    mask = ok[:, None] & k_ok[None, :]
    x = tl.load(window_ptr + ch[:, None] * stride_c + offs[None, :], mask=mask, other=0.0)
    w = tl.load(w_ptr + ch[:, None] * K + offs[None, :], mask=mask, other=0.0)
    dtype = window_ptr.dtype.element_ty
    conv = as_stored(tl.sum(x.to(tl.float32) * w.to(tl.float32), axis=1), dtype).to(tl.float32)
    return as_stored(conv / (1.0 + tl.exp(-conv)), dtype).to(tl.float32)


@triton.jit
def _gated_delta_step_kernel(
    window_ptr,
    w_ptr,
    b_ptr,
    a_ptr,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    rows_ptr,
    core_ptr,
    key_dim,
    head_k,
    head_v,
    repeat,
    stride_wt,
    stride_wc,
    stride_bt,
    stride_at,
    stride_sr,
    stride_sh,
    stride_sk,
    stride_ct,
    stride_ch,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    t = tl.program_id(0)
    vh = tl.program_id(1)
    vb = tl.program_id(2)
    kh = vh // repeat
    row = tl.load(rows_ptr + t).to(tl.int64)
    window = window_ptr + t * stride_wt
    offs_k = tl.arange(0, BLOCK_DK)
    k_ok = offs_k < head_k
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = offs_v < head_v
    q = _conv_silu(window, stride_wc, kh * head_k + offs_k, k_ok, w_ptr, K, BLOCK_K)
    k = _conv_silu(window, stride_wc, key_dim + kh * head_k + offs_k, k_ok, w_ptr, K, BLOCK_K)
    v = _conv_silu(window, stride_wc, 2 * key_dim + vh * head_v + offs_v, v_ok, w_ptr, K,
                   BLOCK_K)  # fmt: skip
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6))
    q = q * (1.0 / tl.sqrt(head_k.to(tl.float32)))
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
    b = tl.load(b_ptr + t * stride_bt + vh).to(tl.float32)
    beta = as_stored(1.0 / (1.0 + tl.exp(-b)), b_ptr.dtype.element_ty).to(tl.float32)
    x = tl.load(a_ptr + t * stride_at + vh).to(tl.float32) + tl.load(dt_bias_ptr + vh).to(
        tl.float32
    )
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
    g = -tl.exp(tl.load(a_log_ptr + vh).to(tl.float32)) * softplus
    tile = state_ptr + row * stride_sr + vh * stride_sh
    tile = tile + offs_k[:, None] * stride_sk + offs_v[None, :]
    mask = k_ok[:, None] & v_ok[None, :]
    s = tl.load(tile, mask=mask, other=0.0) * tl.exp(g)
    memory = tl.sum(s * k[:, None], axis=0)
    delta = (v - memory) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(tile, s, mask=mask)
    core = tl.sum(s * q[:, None], axis=0)
    tl.store(core_ptr + t * stride_ct + vh * stride_ch + offs_v, core, mask=v_ok)


def gated_delta_step(
    window: Tensor,
    conv_weight: Tensor,
    b: Tensor,
    a: Tensor,
    a_log: Tensor,
    dt_bias: Tensor,
    state: Tensor,
    rows: Tensor,
    key_heads: int,
) -> Tensor:
    """core [T, Hv, Dv] fp32 of one token per row, the rows' states [R, Hv, Dk, Dv] (fp32)
    updated in place at rows [T]: window [T, C, K] (each row's K - 1 previous conv inputs
    and its token's projection, contiguous), conv_weight [C, 1, K] (no bias), b / a [T, Hv],
    a_log / dt_bias [Hv]; key_heads: Hk (each serves Hv / Hk consecutive value heads)."""
    tokens, channels, width = window.shape
    _, v_heads, head_k, head_v = state.shape
    key_dim = key_heads * head_k
    if channels != 2 * key_dim + v_heads * head_v or not window.is_contiguous():
        raise ValueError(f"gated_delta_step: window {tuple(window.shape)} (contiguous: "
                         f"{window.is_contiguous()}) for {key_heads} key heads of {head_k} and "
                         f"state {tuple(state.shape)}: expected [T, {2 * key_dim + v_heads * head_v}"
                         f", K] contiguous")  # fmt: skip
    if conv_weight.shape != (channels, 1, width) or not conv_weight.is_contiguous():
        raise ValueError(f"gated_delta_step: conv_weight {tuple(conv_weight.shape)}; expected "
                         f"[{channels}, 1, {width}] contiguous (the layer's conv1d.weight)")  # fmt: skip
    if b.stride(-1) != 1 or a.stride(-1) != 1:
        raise ValueError(f"gated_delta_step: b / a strides {b.stride()} / {a.stride()}; "
                         "expected each row's heads contiguous")  # fmt: skip
    if state.dtype != torch.float32 or state.stride(-1) != 1:
        raise ValueError(f"gated_delta_step: state {state.dtype} strides {state.stride()}; "
                         "expected fp32 with Dv contiguous")  # fmt: skip
    core = torch.empty(tokens, v_heads, head_v, dtype=torch.float32, device=window.device)
    if tokens:
        _gated_delta_step_kernel[(tokens, v_heads, triton.cdiv(head_v, BLOCK_V))](
            window, conv_weight, b, a, a_log, dt_bias, state, rows, core, key_dim, head_k,
            head_v, v_heads // key_heads, window.stride(0), window.stride(1), b.stride(0),
            a.stride(0), *state.stride()[:3], core.stride(0), core.stride(1), K=width,
            BLOCK_K=next_pow2(width), BLOCK_DK=next_pow2(head_k), BLOCK_V=BLOCK_V, num_warps=4,
        )  # fmt: skip
    return core


@triton.jit
def _gated_rms_norm_kernel(
    core_ptr,
    z_ptr,
    w_ptr,
    out_ptr,
    width,
    eps,
    stride_ct,
    stride_ch,
    stride_zt,
    stride_ot,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    ok = offs < width
    dtype = z_ptr.dtype.element_ty
    x = tl.load(core_ptr + t * stride_ct + h * stride_ch + offs, mask=ok, other=0.0)
    x = as_stored(x, dtype).to(tl.float32)
    var = tl.sum(x * x, axis=0) / width
    x = as_stored(x * (1.0 / tl.sqrt(var + eps)), dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    y = as_stored(w * x, dtype).to(tl.float32)
    z = tl.load(z_ptr + t * stride_zt + h * width + offs, mask=ok, other=0.0).to(tl.float32)
    y = y * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + t * stride_ot + h * width + offs, as_stored(y, dtype), mask=ok)


def gated_rms_norm(core: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """out [T, Hv x Dv] in z's dtype: core [T, Hv, Dv] (fp32) normed per head, times weight
    [Dv] (z's dtype), times silu(z) (z [T, Hv x Dv])."""
    tokens, heads, width = core.shape
    if z.shape != (tokens, heads * width) or z.stride(-1) != 1 or weight.shape != (width,):
        raise ValueError(f"gated_rms_norm: core {tuple(core.shape)}, z {tuple(z.shape)}, "
                         f"weight {tuple(weight.shape)}; expected z [{tokens}, {heads * width}] "
                         f"(last dim contiguous), weight [{width}]")  # fmt: skip
    out = torch.empty(tokens, heads * width, dtype=z.dtype, device=z.device)
    if tokens:
        _gated_rms_norm_kernel[(tokens, heads)](
            core, z, weight, out, width, eps, core.stride(0), core.stride(1), z.stride(0),
            out.stride(0), BLOCK=next_pow2(width), num_warps=1 if width <= 256 else 4,
        )  # fmt: skip
    return out
