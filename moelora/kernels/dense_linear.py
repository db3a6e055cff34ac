"""Up to three dense Linears of one input (a decode step's q / k / v, or o alone) as one
skinny GEMM over their weights read in place, each row's LoRA delta added in its epilogue:

    out_m[t] = round( round(x[t] @ W_m^T + b_m) + round(z_m[t] @ B_m[s_t]^T) )
    z_m[t]   = round( x[t] @ A_m[s_t]^T )                 s_t = slots[t] >= 0

with PEFT's roundings (the base output and the rank intermediate in x's dtype, the delta
rounded before it is added; the bank's B carries the scaling). Rows of slot -1 and modules
without LoRA get the base output alone, as F.linear rounds it.

Two launches: `lora_shrink` computes z for every module with LoRA (one program per token,
module and rank lane: a dot of two rows of N, so its loop is short and the programs many);
`dense_linear` runs the GEMM, its programs spread over the concatenated output columns of
the modules (each program one module's block of BLOCK_M columns, the weight picked by the
program's index), a tile of BLOCK_T rows, the K loop pipelined; the expand reads the row's
slot of B in the epilogue, R lanes. Legend: T tokens, L slots, R max rank, N in features,
M_m out features of module m.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..tiling.geometry import next_pow2
from .output import as_stored

# Output columns per GEMM program, halved (down to 16) while the launch would have fewer
# than MIN_PROGRAMS programs: the 5120 q/k/v columns of Qwen3-30B-A3B run 80 programs of 64,
# its o_proj's 2048 columns 64 programs of 32 (measured on the H200 against 64 and 128,
# benchmarks/ab_dense_linear.py: BENCHMARKS.md "Decode step"). The K loop's tile and stages
# keep 48-64 KB of weight in flight per program.
BLOCK_M, MIN_PROGRAMS, BLOCK_K, STAGES = 64, 64, 128, 4
# Inputs per shrink load: the dot of one token's x with one rank row of A in two loads at N
# = 2048. Reasoned.
SHRINK_K = 1024
MAX_MODULES = 3


@triton.jit
def _dense_shrink_kernel(
    x_ptr,
    slots_ptr,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    z_ptr,
    in_features,
    rank,
    stride_xt,
    stride_al,
    stride_ar,
    stride_zm,
    stride_zt,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    m = tl.program_id(1)
    r = tl.program_id(2)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    if m == 0:
        a_ptr = a0_ptr
    elif m == 1:
        a_ptr = a1_ptr
    else:
        a_ptr = a2_ptr
    a_row = a_ptr + slot.to(tl.int64) * stride_al + r * stride_ar
    acc = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < in_features
        xk = tl.load(x_ptr + t * stride_xt + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        ak = tl.load(a_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        acc += xk * ak
    # PEFT holds lora_A's output in x's dtype
    tl.store(
        z_ptr + m * stride_zm + t * stride_zt + r, tl.sum(acc, axis=0).to(z_ptr.dtype.element_ty)
    )


@triton.jit
def _dense_linear_kernel(
    x_ptr,
    slots_ptr,
    z_ptr,
    w0_ptr,
    w1_ptr,
    w2_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    bt0_ptr,
    bt1_ptr,
    bt2_ptr,
    out0_ptr,
    out1_ptr,
    out2_ptr,
    tokens,
    in_features,
    out0,
    out1,
    out2,
    blocks0,
    blocks01,
    lora0,
    lora1,
    lora2,
    rank,
    stride_xt,
    stride_zm,
    stride_zt,
    HAS_BIAS: tl.constexpr,
    ANY_LORA: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    # the module this program's columns belong to, and the block within it
    if pid < blocks0:
        mod, block, w_ptr, b_ptr, bt_ptr, out_ptr, width, lora = (
            0, pid, w0_ptr, b0_ptr, bt0_ptr, out0_ptr, out0, lora0)  # fmt: skip
    elif pid < blocks01:
        mod, block, w_ptr, b_ptr, bt_ptr, out_ptr, width, lora = (
            1, pid - blocks0, w1_ptr, b1_ptr, bt1_ptr, out1_ptr, out1, lora1)  # fmt: skip
    else:
        mod, block, w_ptr, b_ptr, bt_ptr, out_ptr, width, lora = (
            2, pid - blocks01, w2_ptr, b2_ptr, bt2_ptr, out2_ptr, out2, lora2)  # fmt: skip
    dtype = out_ptr.dtype.element_ty
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < tokens
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < width
    acc = tl.zeros([BLOCK_T, BLOCK_M], tl.float32)
    for k0 in tl.range(0, in_features, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < in_features
        xk = tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_k[None, :],
                     mask=t_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        wk = tl.load(w_ptr + offs_m[:, None].to(tl.int64) * in_features + offs_k[None, :],
                     mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        if IEEE:
            acc = tl.dot(xk, tl.trans(wk), acc, input_precision="ieee")
        else:
            acc = tl.dot(xk, tl.trans(wk), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)[None, :]
    out = as_stored(acc, dtype)
    if ANY_LORA:
        if lora != 0:
            slots = tl.load(slots_ptr + offs_t, mask=t_ok, other=-1)
            s_ok = slots >= 0
            # B^T banks are contiguous [L, R, M_m]: a slot's rows are R * M_m apart
            bt_rows = bt_ptr + tl.where(s_ok, slots, 0).to(tl.int64) * (rank * width)
            delta = tl.zeros([BLOCK_T, BLOCK_M], tl.float32)
            for r in range(0, rank):
                zr = tl.load(z_ptr + mod * stride_zm + offs_t * stride_zt + r, mask=s_ok,
                             other=0.0).to(tl.float32)  # fmt: skip
                br = tl.load(bt_rows[:, None] + r * width + offs_m[None, :],
                             mask=s_ok[:, None] & m_ok[None, :], other=0.0)  # fmt: skip
                delta += zr[:, None] * br.to(tl.float32)
            delta = as_stored(delta, dtype).to(tl.float32)
            out = tl.where(s_ok[:, None], as_stored(out.to(tl.float32) + delta, dtype), out)
    tl.store(out_ptr + offs_t[:, None] * width + offs_m[None, :], out,
             mask=t_ok[:, None] & m_ok[None, :])  # fmt: skip


def lora_shrink(x: Tensor, slots: Tensor, a: list[Tensor | None]) -> Tensor:
    """z [len(a), T, R] in x's dtype: each token's x @ A_m[slot]^T for the modules whose bank
    a[m] ([L, R, N]) is given (None: no LoRA on module m, its z left unwritten; slot -1
    rows too). Every given bank must have one shape."""
    given = [t for t in a if t is not None]
    if not given:
        raise ValueError("lora_shrink: no bank given")
    shape = given[0].shape
    if any(t.shape != shape or t.stride() != given[0].stride() for t in given):
        raise ValueError(f"lora_shrink: banks of shapes {[tuple(t.shape) for t in given]}")
    tokens, rank = x.shape[0], shape[1]
    z = torch.empty(len(a), tokens, rank, dtype=x.dtype, device=x.device)
    pointers = [t if t is not None else given[0] for t in a]
    pointers += [given[0]] * (MAX_MODULES - len(pointers))
    if tokens:
        _dense_shrink_kernel[(tokens, len(a), rank)](
            x, slots, *pointers, z, x.shape[1], rank, x.stride(0), given[0].stride(0),
            given[0].stride(1), z.stride(0), z.stride(1),
            BLOCK_K=min(SHRINK_K, next_pow2(x.shape[1])), num_warps=4,
        )  # fmt: skip
    return z


def dense_linear(
    x: Tensor,
    weights: list[Tensor],
    biases: list[Tensor | None],
    slots: Tensor | None = None,
    z: Tensor | None = None,
    bt: list[Tensor | None] | None = None,
) -> list[Tensor]:
    """[x @ W_m^T + b_m (+ each row's LoRA delta)] for up to three Linears of the same input
    x [T, N] (W_m [M_m, N] contiguous, the model's own). LoRA: slots [T] int (-1: none), z from
    lora_shrink over the same modules in the same order, bt[m] the module's bank of B^T
    [L, R, M_m] (None: no LoRA on module m)."""
    if not 1 <= len(weights) <= MAX_MODULES:
        raise ValueError(f"dense_linear: {len(weights)} weights; 1 to {MAX_MODULES}")
    tokens, hidden = x.shape
    if x.stride(1) != 1 or any(not w.is_contiguous() or w.shape[1] != hidden for w in weights):
        raise ValueError(
            f"dense_linear: weights {[tuple(w.shape) for w in weights]}, x {tuple(x.shape)}"
        )
    outs = [torch.empty(tokens, w.shape[0], dtype=x.dtype, device=x.device) for w in weights]
    bt = list(bt) if bt is not None else [None] * len(weights)
    any_lora = any(b is not None for b in bt)
    if any_lora and (slots is None or z is None):
        raise ValueError("dense_linear: LoRA banks given without slots and z")
    block_m = BLOCK_M
    while block_m > 16 and sum(triton.cdiv(w.shape[0], block_m) for w in weights) < MIN_PROGRAMS:
        block_m //= 2
    blocks = [triton.cdiv(w.shape[0], block_m) for w in weights]
    pad = MAX_MODULES - len(weights)
    ws, outs_p = weights + [weights[0]] * pad, outs + [outs[0]] * pad
    widths = [w.shape[0] for w in weights] + [0] * pad
    has_bias = any(b is not None for b in biases)
    bs = [b if b is not None else torch.zeros(w.shape[0], dtype=x.dtype, device=x.device)
          for b, w in zip(biases, weights)] if has_bias else list(ws)  # fmt: skip
    bs += [bs[0]] * (MAX_MODULES - len(bs))
    bank = next((b for b in bt if b is not None), None)
    if any(b is not None and (not b.is_contiguous() or b.shape[1] != bank.shape[1]
                              or b.shape[2] != w.shape[0]) for b, w in zip(bt, weights)):  # fmt: skip
        raise ValueError(
            f"dense_linear: B^T banks {[None if b is None else tuple(b.shape) for b in bt]}"
        )
    bts = [b if b is not None else (bank if bank is not None else ws[0]) for b in bt]
    bts += [bts[0]] * pad
    flags = [int(b is not None) for b in bt] + [0] * pad
    zz = z if z is not None else x
    rank = bank.shape[1] if bank is not None else 0
    block_t = 16 if tokens <= 16 else (32 if tokens <= 32 else 64)
    if tokens:
        grid = (sum(blocks), triton.cdiv(tokens, block_t))
        _dense_linear_kernel[grid](
            x, slots if slots is not None else x, zz, *ws, *bs, *bts, *outs_p, tokens, hidden,
            *widths, blocks[0], blocks[0] + (blocks[1] if len(blocks) > 1 else 0), *flags, rank,
            x.stride(0), zz.stride(0) if z is not None else 0, zz.stride(1) if z is not None else 0,
            HAS_BIAS=has_bias, ANY_LORA=any_lora, IEEE=x.dtype == torch.float32,
            BLOCK_T=block_t, BLOCK_M=block_m, BLOCK_K=BLOCK_K, STAGES=STAGES, num_warps=4,
        )  # fmt: skip
    return outs
