"""Top-k reduction: y[t] = sum_j o[t, j] over the pairs routed to a valid expert, in fp32.

No atomics (bf16 atomics are slow or unsupported): one program sums the K rows of a
token tile. ADD mode adds into the existing output (read in fp32), OVERWRITE replaces it.
Pairs routed outside [0, E) (expert parallel) were never written and are skipped.

Legend: T tokens, K top-k, H hidden.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_shape


@triton.jit
def _topk_reduce_kernel(
    o_ptr,
    topk_ids_ptr,
    y_ptr,
    num_tokens,
    top_k,
    num_experts,
    hidden,
    stride_om,
    stride_on,
    stride_im,
    stride_ik,
    stride_ym,
    stride_yn,
    ADD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < num_tokens
    n_mask = offs_n < hidden
    mask = m_mask[:, None] & n_mask[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
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
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
    if ADD:
        acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def topk_reduce(
    o: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    out: torch.Tensor | None = None,
    add: bool = False,
    block_m: int = 4,
    block_n: int = 1024,
) -> torch.Tensor:
    """o [P, H] per-pair outputs, topk_ids [T, K] -> y [T, H] (into `out` if given; add=True
    adds to it). Defaults: 4 tokens x 1024 columns per program keeps every load 2 KB wide
    and the grid >= 2 programs per SM from T = 128 on (H = 2048); not tuned further."""
    num_tokens, top_k = topk_ids.shape
    hidden = o.shape[1]
    check_shape("per-pair output", o, (num_tokens * top_k, hidden))
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=o.dtype, device=o.device)
    check_shape("out", out, (num_tokens, hidden))
    block_n = min(block_n, triton.next_power_of_2(hidden))
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(hidden, block_n))
    _topk_reduce_kernel[grid](
        o_ptr=o,
        topk_ids_ptr=topk_ids,
        y_ptr=out,
        num_tokens=num_tokens,
        top_k=top_k,
        num_experts=num_experts,
        hidden=hidden,
        stride_om=o.stride(0),
        stride_on=o.stride(1),
        stride_im=topk_ids.stride(0),
        stride_ik=topk_ids.stride(1),
        stride_ym=out.stride(0),
        stride_yn=out.stride(1),
        ADD=add,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
    return out
