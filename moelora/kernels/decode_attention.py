"""Attention of one new token per row over that row's paged KV cache (decode), split over
the keys.

The cache is paged (vLLM's layout): NB blocks of BS positions each, and a block table whose
row r lists the blocks of logical row r, position p in block block_table[r, p // BS] at
offset p % BS. Block ids are arbitrary (in any order; rows may share blocks, a shared
prefix). Row t reads block-table row t, positions 0 .. lengths[t] - 1 (a loop bound read
on the device: a CUDA graph captured at the table's full length reads only what each row
holds; neither a block nor a table entry past a row's length is read, so those entries may
hold anything). BS is a runtime argument: one compile serves every block size. One program
per (row, KV head, split of the positions) takes the KV head's group of query heads
together (grouped-query attention), scores in fp32, an online softmax, and writes its
unnormalized output with its max and sum; a second kernel combines the splits. With one
split the first kernel writes the output itself. fp32 inputs take exact fp32 dots (no
tf32), as the model's own attention does. A sliding window (a runtime int, 0: none) starts
each row's positions at its length minus the window, chunked attention (Llama 4's; a runtime
int, 0: none) at its chunk's first position; attention sinks (gpt-oss: a logit per
head in each softmax's sum, with no value) join where the splits are combined.
Legend: T rows, Hq / Hk query / KV heads, G = Hq / Hk, D head width, NB cache blocks, BS
positions per block, R block-table rows, MB blocks per row.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..tiling.geometry import next_pow2
from .output import as_stored
from .tiles import mma

BLOCK_N = 64  # keys per step: a [16, 64] x [64, D] pair of dots; reasoned, not tuned
# Programs worth having in flight on an H200 (132 SMs, two each): splits are added until
# rows x KV heads x splits reach this. Reasoned, not tuned.
TARGET_PROGRAMS = 264


@triton.jit
def _decode_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_table_ptr,
    len_ptr,
    out_ptr,
    part_ptr,
    stat_ptr,
    sink_ptr,
    scale,
    group,
    head_dim,
    split_len,
    kv_block_size,
    window,
    chunk,
    stride_bt,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_km,
    stride_vn,
    stride_vh,
    stride_vm,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_st,
    stride_sh,
    stride_ss,
    SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    t = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(len_ptr + t).to(tl.int32)  # 32-bit block / offset arithmetic below
    first = 0
    if window > 0:  # a sliding window: the last `window` positions
        first = tl.maximum(length - window, 0)
    if chunk > 0:  # chunked attention: the positions of the row's own chunk
        first = tl.maximum(first, (length - 1) // chunk * chunk)
    start = tl.maximum(split * split_len, first)
    end = tl.minimum(split * split_len + split_len, length)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < group
    d_ok = offs_d < head_dim
    heads = kv * group + offs_g
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = block_table_ptr + t * stride_bt
    k_head = k_ptr + kv * stride_kh
    v_head = v_ptr + kv * stride_vh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        # int64: NB x the block stride may pass 2^31 elements
        blk = tl.load(table_row + offs_n // kv_block_size, mask=n_ok, other=0).to(tl.int64)
        in_blk = offs_n % kv_block_size  # offset inside its block
        k_at = k_head + blk[:, None] * stride_kn + in_blk[:, None] * stride_km
        k = tl.load(k_at + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = mma(q, tl.trans(k), tl.zeros([BLOCK_G, BLOCK_N], tl.float32), IEEE) * scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, axis=1)
        v_at = v_head + blk[:, None] * stride_vn + in_blk[:, None] * stride_vm
        v = tl.load(v_at + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
        m = m_new
    rows = g_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:
        if HAS_SINKS:  # each head's sink logit joins the softmax's sum, not its values
            sink = tl.load(sink_ptr + heads, mask=g_ok, other=0.0).to(tl.float32)
            m_all = tl.maximum(m, sink)
            total = total * tl.exp(m - m_all) + tl.exp(sink - m_all)
            acc = acc * tl.exp(m - m_all)[:, None]
        out = acc / total[:, None]
        dst = out_ptr + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, as_stored(out, out_ptr.dtype.element_ty), mask=rows)
    else:
        dst = part_ptr + t * stride_pt + heads[:, None] * stride_ph + split * stride_ps
        tl.store(dst + offs_d[None, :], acc, mask=rows)
        stat = stat_ptr + t * stride_st + heads * stride_sh + split * stride_ss
        tl.store(stat, m, mask=g_ok)
        tl.store(stat + 1, total, mask=g_ok)


@triton.jit
def _combine_kernel(
    part_ptr,
    stat_ptr,
    out_ptr,
    sink_ptr,
    head_dim,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_st,
    stride_sh,
    stride_ss,
    stride_ot,
    stride_oh,
    SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    base = t * stride_pt + h * stride_ph
    stat = stat_ptr + t * stride_st + h * stride_sh + offs_s * stride_ss
    m_s = tl.load(stat)
    l_s = tl.load(stat + 1)
    m = tl.max(m_s, axis=0)
    if HAS_SINKS:
        sink = tl.load(sink_ptr + h).to(tl.float32)
        m = tl.maximum(m, sink)
    w = tl.where(l_s > 0, tl.exp(m_s - m), 0.0)
    total = tl.sum(l_s * w, axis=0)
    if HAS_SINKS:
        total += tl.exp(sink - m)
    part = tl.load(part_ptr + base + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=d_ok[None, :], other=0.0)  # fmt: skip
    out = tl.sum(part * w[:, None], axis=0) / total
    dst = out_ptr + t * stride_ot + h * stride_oh + offs_d
    tl.store(dst, as_stored(out, out_ptr.dtype.element_ty), mask=d_ok)


def splits_for(rows: int, kv_heads: int, max_len: int) -> int:
    """Splits of the positions (a power of two, at most one per BLOCK_N keys) that bring
    rows x KV heads x splits up to TARGET_PROGRAMS."""
    want = max(1, math.ceil(TARGET_PROGRAMS / max(1, rows * kv_heads)))
    cap = max(1, math.ceil(max_len / BLOCK_N))
    return min(next_pow2(want), next_pow2(cap))


def check_sinks(caller: str, sinks: Tensor | None, heads: int) -> None:
    """Raises ValueError unless sinks is None or one contiguous logit per query head."""
    if sinks is not None and (sinks.shape != (heads,) or not sinks.is_contiguous()):
        raise ValueError(f"{caller}: sinks {tuple(sinks.shape)} (contiguous: "
                         f"{sinks.is_contiguous()}); expected [{heads}], one logit per query "
                         "head: pass the attention's sinks (attn.sinks), contiguous")  # fmt: skip


def paged_block_size(caller: str, k_cache: Tensor, v_cache: Tensor, block_table: Tensor) -> int:
    """BS of the paged caches k_cache / v_cache [NB, Hk, BS, D] read through block_table
    [R, MB] (int32, contiguous); raises ValueError naming what does not fit that layout."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{caller}: k_cache {tuple(k_cache.shape)} / v_cache "
                         f"{tuple(v_cache.shape)}; expected both [NB, Hk, BS, D], one shape "
                         "(the paged layout: NB blocks of BS positions)")  # fmt: skip
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError(f"{caller}: k_cache / v_cache strides {k_cache.stride()} / "
                         f"{v_cache.stride()}; expected the head width D contiguous (stride 1): "
                         "allocate the caches contiguous")  # fmt: skip
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(f"{caller}: block_table {block_table.dtype} "
                         f"{tuple(block_table.shape)}; expected [R, MB] torch.int32: build it "
                         "with dtype=torch.int32")  # fmt: skip
    if not block_table.is_contiguous():
        raise ValueError(f"{caller}: block_table strides {block_table.stride()}; expected a "
                         "contiguous [R, MB] table: pass block_table.contiguous()")  # fmt: skip
    return k_cache.shape[2]


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    lengths: Tensor,
    scale: float,
    max_len: int | None = None,
    window: int = 0,
    sinks: Tensor | None = None,
    chunk: int = 0,
) -> Tensor:
    """out [T, Hq, D] for q [T, Hq, D] (row t's one query per head), paged caches k_cache /
    v_cache [NB, Hk, BS, D], block_table [R >= T, MB] int32 (row t of q reads block-table
    row t), lengths [T] (positions 0 .. lengths[t] - 1 are read; 1 <= lengths[t] <= MB x
    BS, not checked: it stays on the device). max_len: the most any row may read (default
    MB x BS): sizes the splits. window > 0: only the last `window` positions are read (a
    sliding window: position p sees p - window < j <= p). sinks [Hq]: one logit per head
    that joins each softmax's sum without a value (gpt-oss's attention sinks). chunk > 0:
    chunked attention (Llama 4): position p sees the positions of its own chunk,
    p // chunk x chunk <= j <= p."""
    check_sinks("decode_attention", sinks, q.shape[1])
    tokens, q_heads, head_dim = q.shape
    kv_block_size = paged_block_size("decode_attention", k_cache, v_cache, block_table)
    if block_table.shape[0] < tokens:
        raise ValueError(f"decode_attention: block_table has {block_table.shape[0]} rows for "
                         f"q of {tokens} rows; expected one row per q row (R >= T)")  # fmt: skip
    kv_heads = k_cache.shape[1]
    group = q_heads // kv_heads
    max_len = block_table.shape[1] * kv_block_size if max_len is None else max_len
    splits = splits_for(tokens, kv_heads, max_len)
    split_len = math.ceil(math.ceil(max_len / splits) / BLOCK_N) * BLOCK_N
    out = torch.empty_like(q)
    if splits > 1:
        part = torch.empty(tokens, q_heads, splits, head_dim, dtype=torch.float32,
                           device=q.device)  # fmt: skip
        stat = torch.empty(tokens, q_heads, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part = stat = out  # not read
    strides = (*part.stride()[:3], *stat.stride()[:3]) if splits > 1 else (0,) * 6
    block_d = next_pow2(head_dim)
    if tokens:
        _decode_attention_kernel[(tokens, kv_heads, splits)](
            q, k_cache, v_cache, block_table, lengths, out, part, stat,
            out if sinks is None else sinks, scale, group, head_dim, split_len, kv_block_size,
            window, chunk, block_table.stride(0), q.stride(0), q.stride(1),
            *k_cache.stride()[:3], *v_cache.stride()[:3], out.stride(0), out.stride(1), *strides,
            SPLITS=splits, BLOCK_G=max(16, next_pow2(group)), BLOCK_N=BLOCK_N,
            BLOCK_D=block_d, IEEE=q.dtype == torch.float32, HAS_SINKS=sinks is not None,
            num_warps=4,
        )  # fmt: skip
        if splits > 1:
            _combine_kernel[(tokens, q_heads)](
                part, stat, out, out if sinks is None else sinks, head_dim, *strides,
                out.stride(0), out.stride(1), SPLITS=splits, BLOCK_D=block_d,
                HAS_SINKS=sinks is not None, num_warps=1,
            )  # fmt: skip
    return out
