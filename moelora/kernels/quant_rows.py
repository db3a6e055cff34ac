"""Per-token FP8 quantization of a base GEMM's input, once per row before the GEMM that
reads it (x before the up GEMM or GEMV, z before the down one): the GEMMs then load e4m3
tiles and their scales. Quantizing inside the GEMM's K loop instead redoes each row's work
in every N tile, and its fp32 tile, divisions and cross-warp amax sit between the MMAs (on
the H200 the in-loop W8A8 layer ran 4-18x slower than this). The arithmetic is the one every
FP8 kernel shares (fp8_tiles.quantize_rows, quant/activation_quant.py), bit for bit.

Legend: T rows, H columns, G = ceil(H / group) groups per row (1: the whole row, FP8_CHANNEL).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_shape
from .fp8_tiles import quantize_by, quantize_rows, row_scales

# rows per program: at most a [32, group] tile (4K values at group 128), fewer for fewer rows
# (a decode step's one row of x took a 32-row tile, 31 rows masked: ~6 us a launch on the
# H200 at T = 1); not tuned (a pass over x is small beside the GEMM that follows it)
BLOCK_M = 32
# columns per step of a whole-row pass (FP8_CHANNEL)
ROW_STEP = 128


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
    WHOLE_ROW: tl.constexpr,
):
    """Rows [pid_m * BLOCK_M, + BLOCK_M): group pid_g's e4m3 values into q and its scales
    into s; WHOLE_ROW: one scale over all columns (a pass for the amax, then one to
    quantize), GROUP the columns of a step."""
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_mask = offs_m < num_rows
    offs_k = tl.arange(0, GROUP)
    if WHOLE_ROW:
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
        q_ptrs = q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :] * stride_qk
        s = row_scales(x_ptrs, m_mask[:, None], num_cols, stride_xk, offs_k)
        for k0 in range(0, num_cols, GROUP):
            mask = m_mask[:, None] & ((k0 + offs_k) < num_cols)[None, :]
            t = tl.load(x_ptrs + k0 * stride_xk, mask=mask, other=0.0)
            tl.store(q_ptrs + k0 * stride_qk, quantize_by(t, s), mask=mask)
    else:
        offs_k += pid_g * GROUP
        mask = m_mask[:, None] & (offs_k < num_cols)[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
        q, s = quantize_rows(tl.load(x_ptrs, mask=mask, other=0.0))  # zeros: amax unchanged
        tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :] * stride_qk, q, mask=mask)
    tl.store(s_ptr + offs_m[:, None] * stride_sm + pid_g * stride_sg, s, mask=m_mask[:, None])


def quant_rows(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (e4m3 [T, H], fp32 scales [T, G]), each row quantized per group of
    `group` columns (a power of two), or as one group (None) as quant/activation_quant.py
    says."""
    check_shape("x", x, (None, None))
    num_rows, num_cols = x.shape
    groups = 1 if group is None else triton.cdiv(num_cols, group)
    q = torch.empty(num_rows, num_cols, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(num_rows, groups, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, s
    block_m = min(BLOCK_M, triton.next_power_of_2(num_rows))
    grid = (triton.cdiv(num_rows, block_m), groups)
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
        BLOCK_M=block_m,
        GROUP=ROW_STEP if group is None else group,
        WHOLE_ROW=group is None,
    )
    return q, s
