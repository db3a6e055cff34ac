"""DeepSeek's multi-head latent attention (MLA) over a paged cache of latents: the attention
of decode rows and of varlen prompts, in the absorbed form (FlashMLA's, vLLM's MLA decode).

The cache holds, per position, the compressed latent c (kv_lora_rank numbers, after its
RMSNorm) and the shared rotary key k_r (qk_rope_head_dim), one row [c, k_r] of width
W = rank + rope: one "KV head" for every query head (MQA), rank + rope numbers a position
where the expanded form holds heads x (nope + rope + v). Each query head h comes as
[q_c, q_r]: q_c = W_UK[h]^T q_nope (the key's up-projection moved onto the query, done by
the caller) and its rotated q_r, so its score against position j is q_c . c_j + q_r . k_r_j
(= q_nope . k_nope_j + q_r . k_r_j, the expanded form's), scaled by `scale`. The output is
the latent sum_j p_j c_j [rank] per head, which the caller projects by W_UV[h].

The paged layout and what is read are decode_attention.py's and prefill_attention.py's:
NB blocks of BS positions, position p of block-table row r in block block_table[r, p // BS]
at offset p % BS, nothing read past a row's last position. A program takes BLOCK_Q tokens x
BLOCK_H heads (at decode one token, one row of the block table, its positions split as
decode_attention splits them; at prefill BLOCK_Q tokens of one packed sequence, causal;
the head blocks of one token block launched next to each other, so the latents they all
read are fetched once into L2), scores in fp32 (the latent and the rotary part as two dots), an online softmax over blocks
of BLOCK_N positions, the probabilities rounded to the cache's dtype for their dot with
the latents (as the model's eager attention rounds its softmax); fp32 inputs take exact
fp32 dots. DeepSeek has no sliding window, sinks or chunked attention: none here.
Legend: T tokens, H query heads, W = rank + rope, NB cache blocks, BS positions per block,
R block-table rows, MB blocks per row.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..tiling.geometry import next_pow2
from .decode_attention import _combine_kernel, splits_for
from .output import as_stored
from .prefill_attention import VarlenTable, block_size, varlen_block
from .tiles import mma

BLOCK_N = 32  # positions per step: a [32, rank] latent tile (32 KB at rank 512, bf16)
ROWS = 32  # BLOCK_Q x BLOCK_H rows of a program's dots: a [32, rank] fp32 accumulator
# (64 KB: 64 registers a thread at 8 warps). Reasoned, not tuned; not yet on a GPU
WARPS = 8


@triton.jit
def _mla_attention_kernel(
    q_ptr,
    c_ptr,
    block_table_ptr,
    out_ptr,
    part_ptr,
    stat_ptr,
    len_ptr,
    block_seq_ptr,
    block_tok_ptr,
    starts_ptr,
    ends_ptr,
    rows_ptr,
    pos0_ptr,
    scale,
    heads,
    rank,
    rope,
    kv_block_size,
    split_len,
    stride_bt,
    stride_qt,
    stride_qh,
    stride_cn,
    stride_cm,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_st,
    stride_sh,
    stride_ss,
    DECODE: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    IEEE: tl.constexpr,
):
    hb = tl.program_id(0)  # head blocks vary fastest: the programs reading the same
    b = tl.program_id(1)  # positions run together, their latents shared in L2
    split = tl.program_id(2)
    if DECODE:  # row b: one token at position lengths[b] - 1 of block-table row b
        t0 = b
        start = b
        end = b + 1
        row = b.to(tl.int64)
        length = tl.load(len_ptr + b).to(tl.int32)
        pos0 = length - 1
        first = split * split_len
        stop = tl.minimum(first + split_len, length)
    else:  # BLOCK_Q tokens of packed sequence s from token t0
        t0, start, end, row, pos0 = varlen_block(b, block_seq_ptr, block_tok_ptr, starts_ptr,
                                                 ends_ptr, rows_ptr, pos0_ptr)  # fmt: skip
        first = 0
        stop = pos0 + tl.minimum(t0 + BLOCK_Q, end) - start  # past the block's last position
    offs_m = tl.arange(0, BLOCK_Q * BLOCK_H)
    tok = t0 + offs_m // BLOCK_H
    h = hb * BLOCK_H + offs_m % BLOCK_H
    m_ok = (tok < end) & (h < heads)
    # each row's own position; padding rows read as the last one (finite, not stored)
    pos = tl.minimum(pos0 + tok - start, stop - 1)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    r_ok = offs_r < rank
    p_ok = offs_p < rope
    q_at = q_ptr + tok[:, None].to(tl.int64) * stride_qt + h[:, None] * stride_qh
    q_c = tl.load(q_at + offs_r[None, :], mask=m_ok[:, None] & r_ok[None, :], other=0.0)
    q_r = tl.load(q_at + rank + offs_p[None, :], mask=m_ok[:, None] & p_ok[None, :], other=0.0)
    m = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_R], tl.float32)
    table_row = block_table_ptr + row * stride_bt
    for n0 in range(first, stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        # int64: NB x the block stride may pass 2^31 elements
        blk = tl.load(table_row + offs_n // kv_block_size, mask=n_ok, other=0).to(tl.int64)
        at = c_ptr + blk[:, None] * stride_cn + (offs_n % kv_block_size)[:, None] * stride_cm
        c = tl.load(at + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        k_r = tl.load(at + rank + offs_p[None, :], mask=n_ok[:, None] & p_ok[None, :], other=0.0)
        scores = mma(q_c, tl.trans(c), tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_N], tl.float32), IEEE)
        scores = mma(q_r, tl.trans(k_r), scores, IEEE) * scale
        scores = tl.where(n_ok[None, :] & (offs_n[None, :] <= pos[:, None]), scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no position seen yet: keep 0
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        total = total * alpha + tl.sum(p, axis=1)
        acc = mma(p.to(c.dtype), c, acc * alpha[:, None], IEEE)
        m = m_new
    rows = m_ok[:, None] & r_ok[None, :]
    if SPLITS == 1:
        # a padding program's empty sequence sums nothing (total 0): divided by 1, stored nowhere
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        dst = out_ptr + tok[:, None].to(tl.int64) * stride_ot + h[:, None] * stride_oh
        tl.store(dst + offs_r[None, :], as_stored(out, out_ptr.dtype.element_ty), mask=rows)
    else:
        dst = part_ptr + tok[:, None] * stride_pt + h[:, None] * stride_ph + split * stride_ps
        tl.store(dst + offs_r[None, :], acc, mask=rows)
        stat = stat_ptr + tok * stride_st + h * stride_sh + split * stride_ss
        tl.store(stat, m, mask=m_ok)
        tl.store(stat + 1, total, mask=m_ok)


def _check(caller: str, q: Tensor, cache: Tensor, block_table: Tensor, rank: int) -> int:
    """BS of the latent cache [NB, 1, BS, W] read through block_table [R, MB] for q [T, H,
    W]; raises ValueError naming what does not fit."""
    if cache.dim() != 4 or cache.shape[1] != 1 or cache.stride(3) != 1:
        raise ValueError(f"{caller}: cache {tuple(cache.shape)} strides {cache.stride()}; "
                         "expected [NB, 1, BS, rank + rope] with the width contiguous (the "
                         "paged latent cache: engine/paged_cache.py)")  # fmt: skip
    if q.dim() != 3 or q.shape[2] != cache.shape[3] or q.stride(2) != 1:
        raise ValueError(f"{caller}: q {tuple(q.shape)}; expected [T, H, {cache.shape[3]}] "
                         "(each head's absorbed latent query, then its rotary part), the width "
                         "contiguous")  # fmt: skip
    if not 0 < rank < cache.shape[3]:
        raise ValueError(f"{caller}: rank {rank} for a cache of width {cache.shape[3]}; "
                         "expected 0 < rank < width (the latent, then the rotary key)")  # fmt: skip
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or not (
            block_table.is_contiguous()):  # fmt: skip
        raise ValueError(f"{caller}: block_table {block_table.dtype} "
                         f"{tuple(block_table.shape)}; expected a contiguous [R, MB] "
                         "torch.int32 table")  # fmt: skip
    return cache.shape[2]


def _launch(q, cache, block_table, out, part, stat, grid, lengths, sequences, scale, rank,
            split_len, **constexprs) -> None:  # fmt: skip
    seq = sequences if sequences is not None else [out] * 6
    strides = (*part.stride()[:3], *stat.stride()[:3]) if part is not out else (0,) * 6
    _mla_attention_kernel[grid](
        q, cache, block_table, out, part, stat, out if lengths is None else lengths, *seq,
        scale, q.shape[1], rank, q.shape[2] - rank, cache.shape[2], split_len,
        block_table.stride(0), q.stride(0), q.stride(1), cache.stride(0), cache.stride(2),
        out.stride(0), out.stride(1), *strides, BLOCK_N=BLOCK_N,
        BLOCK_R=max(16, next_pow2(rank)), BLOCK_P=max(16, next_pow2(q.shape[2] - rank)),
        IEEE=q.dtype == torch.float32, num_warps=WARPS, **constexprs,
    )  # fmt: skip


def mla_decode_attention(
    q: Tensor,
    cache: Tensor,
    block_table: Tensor,
    lengths: Tensor,
    scale: float,
    rank: int,
    max_len: int | None = None,
) -> Tensor:
    """out [T, H, rank] (each head's latent output) for q [T, H, W] (row t's one token:
    each head's absorbed query then its rotary part), the paged latent cache [NB, 1, BS, W]
    ([c, k_r] per position), block_table [R >= T, MB] int32 (row t reads block-table row t),
    lengths [T] (positions 0 .. lengths[t] - 1; 1 <= lengths[t] <= MB x BS, not checked: it
    stays on the device); max_len: the most any row reads (default MB x BS): sizes the
    splits of the positions."""
    block = _check("mla_decode_attention", q, cache, block_table, rank)
    tokens, heads, _ = q.shape
    if block_table.shape[0] < tokens:
        raise ValueError(f"mla_decode_attention: block_table has {block_table.shape[0]} rows "
                         f"for q of {tokens} rows; expected one row per q row (R >= T)")  # fmt: skip
    block_h = 16  # a dot's rows: one token's heads
    head_blocks = triton.cdiv(heads, block_h)
    max_len = block_table.shape[1] * block if max_len is None else max_len
    splits = splits_for(tokens, head_blocks, max_len)
    split_len = math.ceil(math.ceil(max_len / splits) / BLOCK_N) * BLOCK_N
    out = q.new_empty(tokens, heads, rank)
    part = stat = out  # not read with one split
    if splits > 1:
        part = torch.empty(tokens, heads, splits, rank, dtype=torch.float32, device=q.device)
        stat = torch.empty(tokens, heads, splits, 2, dtype=torch.float32, device=q.device)
    if tokens:
        _launch(q, cache, block_table, out, part, stat, (head_blocks, tokens, splits), lengths,
                None, scale, rank, split_len, DECODE=True, SPLITS=splits, BLOCK_Q=1,
                BLOCK_H=block_h)  # fmt: skip
        if splits > 1:
            _combine_kernel[(tokens, heads)](
                part, stat, out, out, rank, *part.stride()[:3], *stat.stride()[:3],
                out.stride(0), out.stride(1), SPLITS=splits, BLOCK_D=next_pow2(rank),
                HAS_SINKS=False, num_warps=4,
            )  # fmt: skip
    return out


def mla_prefill_attention(
    q: Tensor,
    cache: Tensor,
    table: VarlenTable,
    block_table: Tensor,
    scale: float,
    rank: int,
) -> Tensor:
    """out [T, H, rank] for q [T, H, W] packing the sequences `table` describes (varlen_table
    built for a group of H query heads: one latent head for all of them), the paged latent
    cache [NB, 1, BS, W] already holding every position read, block_table [R, MB] int32
    (sequence s reads its row rows[s]; not checked past its shape: it stays on the device).
    Causal: each token reads positions 0 .. its own."""
    _check("mla_prefill_attention", q, cache, block_table, rank)
    tokens, heads, _ = q.shape
    if table.tokens != tokens or table.block_q != block_size(heads):
        raise ValueError(f"mla_prefill_attention: a table of {table.tokens} tokens in blocks of "
                         f"{table.block_q} for q {tuple(q.shape)}; build it with "
                         f"varlen_table(..., group={heads})")  # fmt: skip
    block_h = min(next_pow2(heads), max(1, ROWS // table.block_q))
    out = q.new_empty(tokens, heads, rank)
    programs = table.blocks.shape[1]
    if programs:
        seq = table.sequences
        sequences = (table.blocks[0], table.blocks[1], seq[0], seq[1], seq[2], seq[3])
        _launch(q, cache, block_table, out, out, out,
                (triton.cdiv(heads, block_h), programs, 1), None, sequences, scale, rank, 0,
                DECODE=False, SPLITS=1, BLOCK_Q=table.block_q, BLOCK_H=block_h)  # fmt: skip
    return out
