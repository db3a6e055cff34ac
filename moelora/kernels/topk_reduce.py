"""Top-k reduction: y[t] = sum_j o[t, j] over the pairs routed to a valid expert, in fp32.

No atomics (bf16 atomics are slow or unsupported): one program sums the K rows of a
token tile. ADD mode adds into the existing output (read in fp32), OVERWRITE replaces it.
Pairs routed outside [0, E) (expert parallel) were never written and are skipped.

With a down-LoRA delta (lora_delta with delta_in_reduce), each pair's delta row [H] is
added too, times its routing weight (unless the weight was applied to the input), for
tokens with an adapter: the down GEMM then runs LoRA-free, and the delta rows are read
here in a streaming pass instead of as an extra tile load in each GEMM epilogue.

Legend: T tokens, K top-k, H hidden.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import InputError
from .checks import check_shape, workspace
from .launch_args import strides
from .output import store_y
from .pdl import chain_point


@triton.jit
def _topk_reduce_kernel(
    o_ptr,
    topk_ids_ptr,
    y_ptr,
    delta_ptr,
    weights_ptr,
    slots_ptr,
    num_tokens,
    top_k,
    num_experts,
    num_slots,
    hidden,
    stride_om,
    stride_on,
    stride_im,
    stride_ik,
    stride_ym,
    stride_yn,
    stride_dm,
    stride_dn,
    ADD: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    chain_point(PDL)  # nothing is read before the wait (kernels/pdl.py)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < num_tokens
    n_mask = offs_n < hidden
    mask = m_mask[:, None] & n_mask[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_DELTA:
        slot = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1)
        has = (slot >= 0) & (slot < num_slots)
    for j in range(0, top_k):
        e = tl.load(topk_ids_ptr + offs_m * stride_im + j * stride_ik, mask=m_mask, other=-1)
        ok = (e >= 0) & (e < num_experts)
        pair = offs_m.to(tl.int64) * top_k + j
        v = tl.load(
            o_ptr + pair[:, None] * stride_om + offs_n[None, :] * stride_on,
            mask=mask & ok[:, None],
            other=0.0,
        )
        acc += tl.where(ok[:, None], v.to(tl.float32), 0.0)
        if HAS_DELTA:  # rows of tokens without an adapter were never written
            d = tl.load(
                delta_ptr + pair[:, None] * stride_dm + offs_n[None, :] * stride_dn,
                mask=mask & (ok & has)[:, None],
                other=0.0,
            ).to(tl.float32)
            if MUL_WEIGHT:
                g = tl.load(weights_ptr + pair, mask=m_mask & ok & has, other=0.0)
                d = d * g.to(tl.float32)[:, None]
            acc += d
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
    store_y(y_ptrs, acc, mask, ADD)


def topk_reduce(
    o: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    out: torch.Tensor | None = None,
    add: bool = False,
    delta: torch.Tensor | None = None,
    token_slots: torch.Tensor | None = None,
    num_slots: int = 0,
    topk_weights: torch.Tensor | None = None,
    block_m: int = 4,
    block_n: int = 1024,
    pdl: bool = False,
) -> torch.Tensor:
    """o [P, H] per-pair outputs, topk_ids [T, K] -> y [T, H] (into `out` if given; add=True
    adds to it). delta [P, H] (down-LoRA delta rows, written for tokens whose slot in
    token_slots [T] is in [0, num_slots)) is added, times topk_weights [T, K] if given. Defaults: 4 tokens x 1024 columns per program keeps every load 2 KB wide
    and the grid >= 2 programs per SM from T = 128 on (H = 2048); not tuned further."""
    num_tokens, top_k = topk_ids.shape
    hidden = o.shape[1]
    check_shape("per-pair output", o, (num_tokens * top_k, hidden))
    if out is None:
        out = workspace(num_tokens, hidden, dtype=o.dtype, device=o.device)
    check_shape("out", out, (num_tokens, hidden))
    has_delta = delta is not None
    if has_delta:
        check_shape("LoRA delta", delta, (num_tokens * top_k, hidden))
        if token_slots is None or num_slots <= 0:
            raise InputError(
                "token_slots",
                f"{'None' if token_slots is None else 'given'} with num_slots = {num_slots}",
                "the [T] token slots and num_slots > 0 whenever a LoRA delta is passed",
            )
        check_shape("token_slots", token_slots, (num_tokens,))
        token_slots = token_slots.contiguous()
        if topk_weights is not None:
            check_shape("topk_weights", topk_weights, (num_tokens, top_k))
            topk_weights = topk_weights.contiguous()
    block_n = min(block_n, triton.next_power_of_2(hidden))
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(hidden, block_n))
    _topk_reduce_kernel[grid](
        o_ptr=o,
        topk_ids_ptr=topk_ids,
        y_ptr=out,
        delta_ptr=delta if has_delta else o,
        weights_ptr=topk_weights.reshape(-1) if topk_weights is not None else o,
        slots_ptr=token_slots if has_delta else topk_ids,
        num_tokens=num_tokens,
        top_k=top_k,
        num_experts=num_experts,
        num_slots=num_slots,
        hidden=hidden,
        **strides("o", o, "mn"),
        **strides("i", topk_ids, "mk"),
        **strides("y", out, "mn"),
        **strides("d", delta, "mn"),
        ADD=add,
        HAS_DELTA=has_delta,
        MUL_WEIGHT=has_delta and topk_weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PDL=pdl,
        launch_pdl=pdl,
    )
    return out
