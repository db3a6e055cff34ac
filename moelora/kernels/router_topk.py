"""The router of a decode step in one kernel: logits = x @ W^T (rounded to x's dtype, as
F.linear returns them), a softmax over the experts in fp32, the top-k, renormalized over the
k when asked, rounded to x's dtype as transformers' routers return them; weights come back
as fp32 [T, K], ids as int32 [T, K], in descending order of weight (torch.topk's order).

One program per token: it reads the router's weight [E, H] (from L2 after the first rows)
and picks the k largest by k rounds of max / argmax (the lowest expert index among equal
probabilities). Replaces the F.linear, softmax, topk, sum, divide and casts (eight
launches) of transformers' routers in the decode runner. Legend: T tokens, H hidden,
E experts, K top-k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..tiling.geometry import next_pow2
from .output import as_stored

# Elements of the [E, BLOCK_H] fp32 product tile: 8192 keeps it in registers. Reasoned.
TILE = 8192


@triton.jit
def _router_topk_kernel(
    x_ptr,
    w_ptr,
    weights_ptr,
    ids_ptr,
    hidden,
    experts,
    top_k,
    stride_xt,
    stride_we,
    stride_ot,
    RENORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < experts
    acc = tl.zeros([BLOCK_E], tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < hidden
        xh = tl.load(x_ptr + t * stride_xt + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_e[:, None] * stride_we + offs_h[None, :],
                    mask=e_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        acc += tl.sum(w * xh[None, :], axis=1)
    logits = as_stored(acc, dtype).to(tl.float32)
    logits = tl.where(e_ok, logits, float("-inf"))
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    offs_k = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], tl.float32)
    top_i = tl.zeros([BLOCK_K], tl.int32)
    left = tl.where(e_ok, probs, -1.0)
    for k in range(0, top_k):
        best = tl.max(left, axis=0)
        pick = tl.min(tl.where(left == best, offs_e, BLOCK_E), axis=0)
        top_w = tl.where(offs_k == k, best, top_w)
        top_i = tl.where(offs_k == k, pick, top_i)
        left = tl.where(offs_e == pick, -1.0, left)
    k_ok = offs_k < top_k
    if RENORM:
        top_w = top_w / tl.sum(tl.where(k_ok, top_w, 0.0), axis=0)
    top_w = as_stored(top_w, dtype).to(tl.float32)
    tl.store(weights_ptr + t * stride_ot + offs_k, top_w, mask=k_ok)
    tl.store(ids_ptr + t * stride_ot + offs_k, top_i, mask=k_ok)


def router_topk(x: Tensor, weight: Tensor, top_k: int, renorm: bool) -> tuple[Tensor, Tensor]:
    """(weights [T, K] fp32, ids [T, K] int32) of x [T, H] through a softmax top-k router of
    weight [E, H] (transformers' Qwen3-MoE / Mixtral / OLMoE routers; renorm: divide by the
    top-k sum, their norm_topk_prob)."""
    tokens, hidden = x.shape
    experts = weight.shape[0]
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=x.device)
    block_e = next_pow2(experts)
    if tokens:
        _router_topk_kernel[(tokens,)](
            x, weight, weights, ids, hidden, experts, top_k,
            x.stride(0), weight.stride(0), weights.stride(0),
            RENORM=renorm, BLOCK_E=block_e,
            BLOCK_H=min(512, max(16, TILE // block_e)), BLOCK_K=max(2, next_pow2(top_k)),
            num_warps=4,
        )  # fmt: skip
    return weights, ids
