"""Per-token LoRA on a dense Linear (attention, router, LM head), added to its output in place:

    out[t] += round( round(x[t] @ A[s_t]^T) @ B[s_t]^T )        s_t = slots[t] >= 0

over the slot each token names only (punica's BGMV shape: no work for other slots, none for
slot -1 rows), with PEFT's roundings (the rank intermediate held in x's dtype, the delta
rounded before it is added). One program per (token, block of output columns): it shrinks
its token's x by its slot's A (R lanes; rows past an adapter's rank are zero in the bank)
and expands into its columns. Legend: T tokens, L slots, R max rank, N in, M out features.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ..tiling.geometry import next_pow2
from .output import as_stored

# Elements of one fp32 tile (R lanes x BLOCK_K inputs, R lanes x BLOCK_M outputs): 8192
# keeps a program in registers at 4 warps; blocks of 32 to 256. Reasoned, not tuned.
TILE = 8192


@triton.jit
def _dense_lora_kernel(
    x_ptr,
    slots_ptr,
    a_ptr,
    bt_ptr,
    out_ptr,
    in_features,
    out_features,
    rank,
    stride_xt,
    stride_al,
    stride_ar,
    stride_bl,
    stride_br,
    stride_ot,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    dtype = out_ptr.dtype.element_ty
    z = tl.zeros([BLOCK_R], tl.float32)
    a = a_ptr + slot.to(tl.int64) * stride_al + offs_r[:, None] * stride_ar
    for k0 in range(0, in_features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < in_features
        xk = tl.load(x_ptr + t * stride_xt + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        ak = tl.load(a + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        ak = ak.to(tl.float32)
        z += tl.sum(ak * xk[None, :], axis=1)
    z = as_stored(z, dtype).to(tl.float32)  # PEFT holds lora_A's output in x's dtype
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < out_features
    bt = tl.load(bt_ptr + slot.to(tl.int64) * stride_bl + offs_r[:, None] * stride_br
                 + offs_m[None, :], mask=r_ok[:, None] & m_ok[None, :],
                 other=0.0).to(tl.float32)  # fmt: skip
    delta = as_stored(tl.sum(bt * z[:, None], axis=0), dtype).to(tl.float32)
    dst = out_ptr + t * stride_ot + offs_m
    base = tl.load(dst, mask=m_ok, other=0.0).to(tl.float32)
    tl.store(dst, as_stored(base + delta, dtype), mask=m_ok)


def add_dense_lora(out: Tensor, x: Tensor, slots: Tensor, a: Tensor, bt: Tensor) -> Tensor:
    """out [T, M] += the LoRA delta of each token's slot, in place; x [T, N], slots [T] int
    (-1: none), a [L, R, N], bt [L, R, M] (a module's bank, moelora/lora/module_banks.py).
    Returns out."""
    tokens = x.shape[0]
    rank = a.shape[1]
    block_r = max(16, next_pow2(rank))
    block = min(256, max(32, TILE // block_r))
    if tokens:
        grid = (tokens, triton.cdiv(out.shape[1], block))
        _dense_lora_kernel[grid](
            x, slots, a, bt, out, x.shape[1], out.shape[1], rank,
            x.stride(0), a.stride(0), a.stride(1), bt.stride(0), bt.stride(1), out.stride(0),
            BLOCK_R=block_r, BLOCK_K=block, BLOCK_M=block, num_warps=4,
        )  # fmt: skip
    return out
