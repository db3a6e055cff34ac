"""Top-k reduce by atomic adds: the down GEMM adds each pair's weighted row into its token's
row of an fp32 [T, H] sum (expert_down's sum_into) instead of writing o [P, H] for
topk_reduce to read back. This module holds that sum's buffer and the pass that finishes it.

What it saves: the P x H round trip of o (at T = 4096 on the Qwen3-30B-A3B layer, 134 MB
written by the down GEMM and read by topk_reduce, in 16-bit). What it costs: zeroing the
T x H fp32 sum, the atomic adds (resolved in L2), and the finishing pass (the sum read, the
output written in its dtype), so it pays only where P x H is large; the tile config says
where (TileConfig.atomic_reduce; docs/kernels.md).

Order: the fp32 adds land in arrival order, so the sum's last bits (and, rarely, the last
bit of a 16-bit output) can differ between runs; the split-K LoRA shrink already sums that
way. Pairs routed outside [0, E) (expert parallel) are never in a block and add nothing,
as topk_reduce skips them.

Legend: T tokens, K top-k, H hidden.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_shape, workspace
from .output import store_y
from .pdl import chain_point


def sum_buffer(
    num_tokens: int,
    hidden: int,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None,
    add: bool,
    device: torch.device,
) -> tuple[torch.Tensor, bool]:
    """(the fp32 [T, H] buffer the down GEMM adds into, whether it is the result itself).

    An fp32 `out` is summed into directly: zeroed first unless add=True, which keeps its
    values as the sum's start. Without `out`, an fp32 layer's result is the zeroed sum
    itself. No finishing pass in either case; otherwise a zeroed workspace to finish.
    """
    if out is not None and out.dtype == torch.float32 and out.is_contiguous():
        check_shape("out", out, (num_tokens, hidden))
        if not add:
            out.zero_()
        return out, True
    acc = workspace(num_tokens, hidden, dtype=torch.float32, device=device).zero_()
    return acc, out is None and dtype == torch.float32


@triton.jit
def _finish_kernel(
    acc_ptr,
    y_ptr,
    numel,
    ADD: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    chain_point(PDL)  # nothing is read before the wait (kernels/pdl.py)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(acc_ptr + offs, mask=mask, other=0.0)
    store_y(y_ptr + offs, acc, mask, ADD)


def finish_sum(
    acc: torch.Tensor,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    add: bool = False,
    block: int = 4096,
    pdl: bool = False,
) -> torch.Tensor:
    """y [T, H] in `dtype` from the fp32 sum acc [T, H] (into `out` if given; add=True adds
    to it). block: elements per program (4096: 16 KB of the sum per program, a grid of
    thousands of programs from T = 1024 on at H = 2048; reasoned, not tuned)."""
    if out is None:
        out = workspace(*acc.shape, dtype=dtype, device=acc.device)
    check_shape("out", out, tuple(acc.shape))
    contiguous = out if out.is_contiguous() else out.contiguous()
    numel = acc.numel()
    _finish_kernel[(triton.cdiv(numel, block),)](
        acc_ptr=acc,
        y_ptr=contiguous,
        numel=numel,
        ADD=add,
        BLOCK=block,
        PDL=pdl,
        launch_pdl=pdl,
    )
    if contiguous is not out:
        out.copy_(contiguous)
    return out
