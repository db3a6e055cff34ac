"""A block-scaled FP8 Linear, W8A8 (transformers' FP8Linear with `activation_scheme:
dynamic`, as vLLM and SGLang run an FP8 checkpoint's attention projections): y [T, N] =
x [T, K] @ W.T (+ bias), W e4m3 [N, K] with one fp32 scale per [bn, bk] block
(`weight_scale_inv`: W ~= e4m3 x scale), x quantized per token and per group of bk columns
(kernels/quant_rows.py, once per input: q / k / v share one) and each K step of bk columns
one FP8 dot scaled by the row's group scale and the block's (fp8_tiles.fp8_mma). The decode
runner's projections of an FP8 checkpoint (engine/runner.py); their LoRA is added after, on
the unquantized x (kernels/dense_lora.py).

Legend: T rows, N outputs, K inputs, bn x bk the weight's scale block (bk the activation
group), BLOCK_T / BLOCK_N a program's tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_shape
from .fp8_tiles import fp8_mma
from .output import as_stored
from .quant_rows import quant_rows

# a tile of rows for tl.dot (16 at least; decode's one row masks the rest) and of outputs;
# not tuned on a GPU yet (kernel log: "FP8 attention on the runner")
BLOCK_T_MAX = 64
BLOCK_N = 64


@triton.jit
def _fp8_linear_kernel(
    q_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    num_out,
    num_in,
    stride_qt,
    stride_qk,
    stride_xst,
    stride_xsg,
    stride_wn,
    stride_wk,
    stride_wsn,
    stride_wsk,
    stride_ot,
    stride_on,
    SCALE_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Rows [pid_t * BLOCK_T, + BLOCK_T) x outputs [pid_n * BLOCK_N, + BLOCK_N); BLOCK_K is
    the scale block's K side (one activation group and one weight scale per step)."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    t_mask = offs_t < num_rows
    n_mask = offs_n < num_out
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, num_in, BLOCK_K):
        k_mask = (k0 + offs_k) < num_in
        a8 = tl.load(
            q_ptr + offs_t[:, None] * stride_qt + (k0 + offs_k)[None, :] * stride_qk,
            mask=t_mask[:, None] & k_mask[None, :], other=0.0,
        )  # fmt: skip
        sa = tl.load(xs_ptr + offs_t[:, None] * stride_xst + (k0 // BLOCK_K) * stride_xsg,
                     mask=t_mask[:, None], other=0.0)  # fmt: skip
        w = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None] * stride_wk,
            mask=k_mask[:, None] & n_mask[None, :], other=0.0,
        )  # fmt: skip
        s_ptrs = ws_ptr + (offs_n // SCALE_N) * stride_wsn + (k0 // BLOCK_K) * stride_wsk
        acc = fp8_mma(a8, sa, w, acc, s_ptrs, n_mask)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_t[:, None] * stride_ot + offs_n[None, :] * stride_on
    tl.store(out_ptrs, as_stored(acc, out_ptr.dtype.element_ty),
             mask=t_mask[:, None] & n_mask[None, :])  # fmt: skip


def quantize_input(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], fp32 scales [T, ceil(K / bk)]): the input of every FP8
    Linear of `block` that reads x (one pass for q / k / v)."""
    return quant_rows(x, block[1])


def fp8_linear(
    quantized: tuple[torch.Tensor, torch.Tensor],
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """y [T, N] in `dtype` from quantize_input(x, block) and an e4m3 weight [N, K] with its
    fp32 block scales [ceil(N / bn), ceil(K / bk)] (+ bias [N])."""
    q, xs = quantized
    rows, cols = q.shape
    check_shape("weight", weight, (None, cols))
    n = weight.shape[0]
    check_shape("weight_scale_inv", scale, (triton.cdiv(n, block[0]), triton.cdiv(cols, block[1])))
    check_shape("activation scales", xs, (rows, triton.cdiv(cols, block[1])))
    out = torch.empty(rows, n, dtype=dtype, device=q.device)
    if rows == 0:
        return out
    block_t = min(BLOCK_T_MAX, max(16, triton.next_power_of_2(rows)))
    grid = (triton.cdiv(rows, block_t), triton.cdiv(n, BLOCK_N))
    _fp8_linear_kernel[grid](
        q, xs, weight, scale, bias if bias is not None else out, out, rows, n, cols,
        q.stride(0), q.stride(1), xs.stride(0), xs.stride(1), weight.stride(0), weight.stride(1),
        scale.stride(0), scale.stride(1), out.stride(0), out.stride(1),
        SCALE_N=block[0], HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_N=BLOCK_N,
        BLOCK_K=block[1],
    )  # fmt: skip
    return out
