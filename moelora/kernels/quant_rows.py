"""Per-token-group FP8 quantization of the up GEMM's input, once per token before the GEMM
(TileConfig.quantize_x): the up GEMM then loads e4m3 tiles and their scales instead of
quantizing each x tile again in every one of its N tiles. The arithmetic is the one every
FP8 kernel shares (fp8_tiles.quantize_rows), so the GEMM's products are the same either way.

Legend: T tokens, H hidden, G = ceil(H / group) groups per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_shape
from .fp8_tiles import quantize_rows

# rows per program: a [32, group] tile (4K values at group 128); not tuned (a pass over x
# is small beside the GEMM that follows it)
BLOCK_M = 32


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    num_rows,
    num_cols,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_qk,
    stride_sm,
    stride_sg,
    BLOCK_M: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Rows [pid_m * BLOCK_M, + BLOCK_M) of group pid_g: e4m3 values into q, scales into s."""
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_k = pid_g * GROUP + tl.arange(0, GROUP)
    m_mask = offs_m < num_rows
    mask = m_mask[:, None] & (offs_k < num_cols)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    q, s = quantize_rows(tl.load(x_ptrs, mask=mask, other=0.0))  # zeros: amax unchanged
    tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :] * stride_qk, q, mask=mask)
    tl.store(s_ptr + offs_m[:, None] * stride_sm + pid_g * stride_sg, s, mask=m_mask[:, None])


def quant_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (e4m3 [T, H], fp32 scales [T, G]), each row quantized per group of
    `group` columns (a power of two) as quant/activation_quant.py says."""
    check_shape("x", x, (None, None))
    num_rows, num_cols = x.shape
    groups = triton.cdiv(num_cols, group)
    q = torch.empty(num_rows, num_cols, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(num_rows, groups, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, s
    grid = (triton.cdiv(num_rows, BLOCK_M), groups)
    _quant_rows_kernel[grid](
        x_ptr=x,
        q_ptr=q,
        s_ptr=s,
        num_rows=num_rows,
        num_cols=num_cols,
        stride_xm=x.stride(0),
        stride_xk=x.stride(1),
        stride_qm=q.stride(0),
        stride_qk=q.stride(1),
        stride_sm=s.stride(0),
        stride_sg=s.stride(1),
        BLOCK_M=BLOCK_M,
        GROUP=group,
    )
    return q, s
