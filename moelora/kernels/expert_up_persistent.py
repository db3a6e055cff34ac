"""The gate/up grouped GEMM as a persistent kernel (the `persistent_up` knob, configs.py):
one program per SM walks the (block, N tile) tiles, and its tile loop and K loop are one
loop to Triton (`tl.range(..., flatten=True)`), so the next tile's first loads are issued
while this tile's last MMAs and its epilogue run. Same math as kernels/expert_up.py.

Why a second kernel: flattening needs the body to be the K loop and straight-line code
around it, so no early exits (a tile past the used blocks is never visited: the loop
bound comes from num_padded; a block of a non-local expert, only in the decode layout,
runs masked), no half-height variants and no in-GEMM LoRA expand (a second loop). It
serves the LoRA-free GEMM and the lora_delta mode (the delta rows are added in the
epilogue); for the rest expert_up runs the regular kernel. Compiled for sm_90 with Triton 3.9 the loops
fuse (tests/test_gemm_compile.py); whether it is faster is for the H200 to say (the
non-persistent up GEMM ran at ~500 TFLOP/s at T = 4096 and 16384, CUTLASS's grouped GEMM
at 649 at T = 16384: KERNEL_LOG.md v20).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..activations import Activation
from .activation import act_code, apply_act
from .align import AlignedPairs
from .checks import precision_flags, tma_box_ok
from .pdl import chain_point
from .tiles import add_delta, block_rows, grouped_pid, mma, z_rows

# Programs per SM: the 8-warp 128-row tiles hold ~255 registers a thread, so one block per
# SM; smaller tiles could hold two, but the loop then shares the SM with a second one.
PROGRAMS_PER_SM = 1
INTERPRETER_PROGRAMS = 3  # on CPU (TRITON_INTERPRET=1): several tiles per program


@triton.jit
def _expert_up_persistent_kernel(
    x_ptr,
    w_ptr,
    w_desc,
    b_ptr,
    z_ptr,
    topk_weights_ptr,
    slots_ptr,
    delta_ptr,
    sorted_pair_ids_ptr,
    block_experts_ptr,
    num_padded_ptr,
    num_pairs,
    top_k,
    num_slots,
    hidden,
    inter_size,
    up_offset,
    row_step,
    alpha,
    limit,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    stride_zm,
    stride_zn,
    stride_dm,
    stride_ds,
    stride_dn,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DELTA: tl.constexpr,
    WEIGHT_INPUT: tl.constexpr,
    Z_SORTED: tl.constexpr,
    W_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    chain_point(PDL)  # nothing is read before the wait (kernels/pdl.py)
    num_pid_n = tl.cdiv(inter_size, BLOCK_N)
    num_pid_m = tl.cdiv(tl.load(num_padded_ptr), BLOCK_M)
    num_tiles = num_pid_m * num_pid_n
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        pid_m, pid_n = grouped_pid(tile, num_pid_m, num_pid_n, GROUP_M)
        row0 = pid_m * BLOCK_M
        expert = tl.load(block_experts_ptr + pid_m)
        pair, row_valid, slot = block_rows(
            sorted_pair_ids_ptr, slots_ptr, row0, num_pairs, top_k, num_slots, BLOCK_M, DELTA
        )
        # a non-local expert's block: all rows masked (as a [BLOCK_M] test: the interpreter
        # cannot load with a mask combined from a scalar comparison)
        row_valid = row_valid & ((pair * 0 + expert) >= 0)
        expert = tl.maximum(expert, 0).to(tl.int64)
        token = (pair // top_k).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < inter_size
        gate_rows = tl.where(n_mask, offs_n, 0) * row_step
        x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :] * stride_xk
        w_base = w_ptr + expert * stride_we + offs_k[:, None] * stride_wk
        wg_ptrs = w_base + gate_rows[None, :] * stride_wn
        wu_ptrs = w_base + (gate_rows + up_offset)[None, :] * stride_wn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_mask = (k0 + offs_k) < hidden
            xt = tl.load(x_ptrs, mask=row_valid[:, None] & k_mask[None, :], other=0.0)
            if W_TMA:
                wg = w_desc.load([expert.to(tl.int32), pid_n * BLOCK_N, k0])
                wg = wg.reshape(BLOCK_N, BLOCK_K).trans()
            else:
                wg = tl.load(wg_ptrs, mask=k_mask[:, None], other=0.0)
            if UPCAST:
                xt = xt.to(tl.float32)
                wg = wg.to(tl.float32)
            acc_g = mma(xt, wg, acc_g, IEEE)
            if GATED:
                if W_TMA:
                    wu = w_desc.load([expert.to(tl.int32), up_offset + pid_n * BLOCK_N, k0])
                    wu = wu.reshape(BLOCK_N, BLOCK_K).trans()
                else:
                    wu = tl.load(wu_ptrs, mask=k_mask[:, None], other=0.0)
                if UPCAST:
                    wu = wu.to(tl.float32)
                acc_u = mma(xt, wu, acc_u, IEEE)
            x_ptrs += BLOCK_K * stride_xk
            wg_ptrs += BLOCK_K * stride_wk
            wu_ptrs += BLOCK_K * stride_wk
        if DELTA:
            acc_g, acc_u = add_delta(
                acc_g, acc_u, delta_ptr, stride_dm, stride_ds, stride_dn, pair, slot, offs_n,
                n_mask, GATED,
            )  # fmt: skip
        if WEIGHT_INPUT:
            g = tl.load(topk_weights_ptr + pair, mask=row_valid, other=0.0).to(tl.float32)
            acc_g = acc_g * g[:, None]
            acc_u = acc_u * g[:, None]
        if HAS_BIAS:
            b_base = b_ptr + expert * stride_be
            acc_g += tl.load(b_base + gate_rows * stride_bn, mask=n_mask, other=0.0).to(tl.float32)[
                None, :
            ]
            if GATED:
                acc_u += tl.load(
                    b_base + (gate_rows + up_offset) * stride_bn, mask=n_mask, other=0.0
                ).to(tl.float32)[None, :]
        z = apply_act(acc_g, acc_u, ACT, alpha, limit)
        z_row = z_rows(row0, pair, BLOCK_M, Z_SORTED)
        z_ptrs = z_ptr + z_row[:, None] * stride_zm + offs_n[None, :] * stride_zn
        tl.store(z_ptrs, z.to(z_ptr.dtype.element_ty), mask=row_valid[:, None] & n_mask[None, :])


def num_programs(device: torch.device, max_tiles: int) -> int:
    """Persistent programs: one per SM (at most one per tile); a few on CPU."""
    if device.type != "cuda":
        return max(1, min(INTERPRETER_PROGRAMS, max_tiles))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(sms * PROGRAMS_PER_SM, max_tiles))


def launch_persistent_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor | None,
    aligned: AlignedPairs,
    out: torch.Tensor,
    *,
    activation: Activation,
    top_k: int,
    alpha: float,
    limit: float,
    topk_weights: torch.Tensor | None,
    token_slots: torch.Tensor | None,
    delta: torch.Tensor | None,
    num_slots: int,
    block_n: int,
    block_k: int,
    group_m: int,
    num_warps: int,
    num_stages: int,
    z_sorted: bool,
    tma: bool,
    pdl: bool,
) -> None:
    """z = act(x @ w13^T [+ delta rows] [+ b13]) into `out` (kernels/expert_up.expert_up
    checks the arguments and calls this when the config asks for the persistent kernel)."""
    num_pairs, inter_size = x.shape[0] * top_k, out.shape[1]
    swiglu = activation is Activation.SWIGLUOAI
    use_tma = tma and not swiglu and tma_box_ok(w13, (1, block_n, block_k))
    if use_tma:
        w_desc = TensorDescriptor(w13, list(w13.shape), list(w13.stride()), [1, block_n, block_k])
    else:
        w_desc = w13  # never read: TMA off
    upcast, ieee = precision_flags(x)
    dummy = x  # never read: its constexpr flag is off
    max_tiles = aligned.num_blocks * triton.cdiv(inter_size, block_n)
    grid = (num_programs(x.device, max_tiles),)
    _expert_up_persistent_kernel[grid](
        x_ptr=x,
        w_ptr=w13,
        w_desc=w_desc,
        b_ptr=b13 if b13 is not None else dummy,
        z_ptr=out,
        topk_weights_ptr=topk_weights.reshape(-1) if topk_weights is not None else dummy,
        slots_ptr=token_slots if delta is not None else dummy,
        delta_ptr=delta if delta is not None else dummy,
        sorted_pair_ids_ptr=aligned.sorted_pair_ids,
        block_experts_ptr=aligned.block_experts,
        num_padded_ptr=aligned.num_padded,
        num_pairs=num_pairs,
        top_k=top_k,
        num_slots=num_slots,
        hidden=x.shape[1],
        inter_size=inter_size,
        up_offset=1 if swiglu else inter_size,
        row_step=2 if swiglu else 1,
        alpha=alpha,
        limit=limit,
        stride_xm=x.stride(0),
        stride_xk=x.stride(1),
        stride_we=w13.stride(0),
        stride_wn=w13.stride(1),
        stride_wk=w13.stride(2),
        stride_be=b13.stride(0) if b13 is not None else 0,
        stride_bn=b13.stride(1) if b13 is not None else 0,
        stride_zm=out.stride(0),
        stride_zn=out.stride(1),
        stride_dm=delta.stride(0) if delta is not None else 0,
        stride_ds=delta.stride(1) if delta is not None else 0,
        stride_dn=delta.stride(2) if delta is not None else 0,
        GATED=activation.is_gated,
        ACT=act_code(activation),
        HAS_BIAS=b13 is not None,
        DELTA=delta is not None,
        WEIGHT_INPUT=topk_weights is not None,
        Z_SORTED=z_sorted,
        W_TMA=use_tma,
        BLOCK_M=aligned.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=group_m,
        UPCAST=upcast,
        IEEE=ieee,
        num_warps=num_warps,
        num_stages=num_stages,
        PDL=pdl,
        launch_pdl=pdl,
    )
