"""The top-k of a softmax router in one kernel: from the router's logits [T, E] (as
F.linear returns them, LoRA delta added), a softmax over the experts in fp32, the top-k,
renormalized over the k when asked, rounded to the logits' dtype as transformers' Qwen3-MoE
and OLMoE routers return them (or kept in fp32, as Mixtral's); weights come back as fp32 [T, K], ids as int32 [T, K], in descending order of
weight (torch.topk's order; among exactly equal probabilities, whose order torch.topk
leaves unspecified, the lowest expert index first).

One program per token reads its E logits and picks the k largest by k rounds of max /
argmax. Replaces the softmax, topk, sum, divide and casts (seven launches) after the
router's GEMV in the decode runner; the GEMV stays cuBLAS', spread over the SMs (a kernel
that also computed the logits, one program per token, read the whole router weight per
token and was slower at batch 1 and 16: docs/history/kernel_log.md, r2). Legend: T tokens,
E experts, K top-k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..tiling.geometry import next_pow2
from .output import as_stored


@triton.jit
def _router_topk_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    experts,
    top_k,
    stride_lt,
    stride_ot,
    RENORM: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    dtype = logits_ptr.dtype.element_ty
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < experts
    logits = tl.load(logits_ptr + t * stride_lt + offs_e, mask=e_ok, other=float("-inf"))
    logits = logits.to(tl.float32)
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
    if ROUND:
        top_w = as_stored(top_w, dtype).to(tl.float32)
    tl.store(weights_ptr + t * stride_ot + offs_k, top_w, mask=k_ok)
    tl.store(ids_ptr + t * stride_ot + offs_k, top_i, mask=k_ok)


def router_topk(
    logits: Tensor, top_k: int, renorm: bool, round_weights: bool = True
) -> tuple[Tensor, Tensor]:
    """(weights [T, K] fp32, ids [T, K] int32) of a softmax top-k router's logits [T, E]
    (transformers' Qwen3-MoE / Mixtral / OLMoE routers; renorm: divide by the top-k sum,
    their norm_topk_prob; round_weights: the weights rounded to the logits' dtype)."""
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        _router_topk_kernel[(tokens,)](
            logits, weights, ids, experts, top_k, logits.stride(0), weights.stride(0),
            RENORM=renorm, ROUND=round_weights, BLOCK_E=next_pow2(experts), BLOCK_K=max(2, next_pow2(top_k)),
            num_warps=1 if experts <= 256 else 4,
        )  # fmt: skip
    return weights, ids
