"""Causal attention of prompts of any lengths, packed one after another (varlen), over each
prompt's row of the paged KV cache: the prefill's attention, with no padding and no mask
tensor.

The cache is paged (vLLM's layout, as kernels/decode_attention.py reads it): NB blocks of
BS positions, position p of block-table row r in block block_table[r, p // BS] at offset
p % BS; block ids in any order, shared between rows where they share a prefix. Sequence s
holds tokens starts[s] .. ends[s] - 1 of the packed q, at positions pos0[s], pos0[s] + 1,
... of block-table row rows[s] (pos0 > 0: a prefix already in the cache, read as well);
each token reads positions 0 .. its own (its k / v written before, as kernels/rope_cache.py
does); neither a block nor a table entry past its sequence's last position is read. One
program per (block of BLOCK_Q tokens of one sequence, KV head) takes the head's group of
query heads with them (BLOCK_Q x G rows of the dots, grouped query attention), scores in
fp32, an online softmax over blocks of BLOCK_N keys up to the block's last position; the
probabilities are rounded to the values' dtype for their dot, as the model's eager
attention does. fp32 inputs take exact fp32 dots (no tf32). A sliding window (a runtime
int, 0: none) limits each token to the positions after its own minus the window, chunked
attention (Llama 4's; a runtime int, 0: none) to its own chunk's, and the key loop starts at
the block's first token's; attention sinks (gpt-oss) join each row's
softmax sum at the end.
Legend: T packed tokens, S sequences, Hq / Hk query / KV heads, G = Hq / Hk, D head width,
NB cache blocks, BS positions per block, R block-table rows, MB blocks per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..tiling.geometry import next_pow2
from .decode_attention import check_sinks, paged_block_size
from .output import as_stored
from .tiles import mma

BLOCK_N = 64  # keys per step; reasoned, not tuned
ROWS = 128  # BLOCK_Q x G rows of a program's dots (BLOCK_Q at least 16); reasoned
# a [ROWS, 128] fp32 accumulator at 4 warps spilled 260 bytes a thread on sm_90 (ptxas, the
# launch as the JIT specializes it); at 8 warps none (tests/test_runner_spills.py)
WARPS = 8


@triton.jit
def varlen_block(b, block_seq_ptr, block_tok_ptr, starts_ptr, ends_ptr, rows_ptr, pos0_ptr):
    """Program b's place in a VarlenTable: (its first token, its sequence's first token and
    end in the packed q, that sequence's block-table row (int64) and first position)."""
    s = tl.load(block_seq_ptr + b)
    start = tl.load(starts_ptr + s)
    end = tl.load(ends_ptr + s)
    row = tl.load(rows_ptr + s).to(tl.int64)
    return tl.load(block_tok_ptr + b), start, end, row, tl.load(pos0_ptr + s)


@triton.jit
def _prefill_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_table_ptr,
    out_ptr,
    block_seq_ptr,
    block_tok_ptr,
    starts_ptr,
    ends_ptr,
    rows_ptr,
    pos0_ptr,
    sink_ptr,
    scale,
    group,
    head_dim,
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
    BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    kv = tl.program_id(1)
    t0, start, end, row, pos0 = varlen_block(b, block_seq_ptr, block_tok_ptr, starts_ptr,
                                             ends_ptr, rows_ptr, pos0_ptr)  # fmt: skip
    last = pos0 + tl.minimum(t0 + BLOCK_Q, end) - 1 - start  # the block's last position
    offs_r = tl.arange(0, BLOCK_Q * BLOCK_G)
    tok = t0 + offs_r // BLOCK_G
    g = offs_r % BLOCK_G
    r_ok = (tok < end) & (g < group)
    # each row's own position; padding rows read as the block's last (finite, not stored)
    pos = tl.minimum(pos0 + tok - start, last)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    heads = kv * group + g
    q = tl.load(q_ptr + tok[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    m = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    table_row = block_table_ptr + row * stride_bt
    k_head = k_ptr + kv * stride_kh
    v_head = v_ptr + kv * stride_vh
    lowest = 0  # the first position a row of the block sees
    if window > 0:  # a sliding window: position p sees p - window < j <= p
        lowest = tl.maximum(pos0 + t0 - start - window + 1, 0)
    if chunk > 0:  # chunked attention: position p sees its own chunk, p // chunk x chunk <= j
        lowest = tl.maximum(lowest, (pos0 + t0 - start) // chunk * chunk)
    for n0 in range(lowest, last + 1, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n <= last
        # int64: NB x the block stride may pass 2^31 elements
        blk = tl.load(table_row + offs_n // kv_block_size, mask=n_ok, other=0).to(tl.int64)
        in_blk = offs_n % kv_block_size  # offset inside its block
        k_at = k_head + blk[:, None] * stride_kn + in_blk[:, None] * stride_km
        k = tl.load(k_at + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        zeros = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_N], tl.float32)
        scores = mma(q, tl.trans(k), zeros, IEEE) * scale
        seen = offs_n[None, :] <= pos[:, None]
        if window > 0:
            seen = seen & (offs_n[None, :] > pos[:, None] - window)
        if chunk > 0:
            seen = seen & (offs_n[None, :] >= pos[:, None] // chunk * chunk)
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        # a row with no key seen yet (a window or chunk starting past this tile: BLOCK_Q may
        # exceed BLOCK_N) keeps 0: exp(-inf - -inf) would be NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        total = total * alpha + tl.sum(p, axis=1)
        v_at = v_head + blk[:, None] * stride_vn + in_blk[:, None] * stride_vm
        v = tl.load(v_at + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
        m = m_new
    if HAS_SINKS:  # each head's sink logit joins the softmax's sum, not its values
        sink = tl.load(sink_ptr + heads, mask=r_ok, other=0.0).to(tl.float32)
        m_all = tl.maximum(m, sink)
        total = total * tl.exp(m - m_all) + tl.exp(sink - m_all)
        acc = acc * tl.exp(m - m_all)[:, None]
    # a padding program's empty sequence sums nothing (total 0): divided by 1, stored nowhere
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    dst = out_ptr + tok[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh
    tl.store(dst + offs_d[None, :], as_stored(out, out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & d_ok[None, :])  # fmt: skip


def block_size(group: int) -> int:
    """Query tokens per program for a group of G query heads per KV head."""
    return max(16, ROWS // next_pow2(group))


@dataclass(frozen=True)
class VarlenTable:
    """Where each packed sequence is and which programs take which tokens, on the device:
    built once per prefill (varlen_table), read by every layer's prefill_attention."""

    tokens: int
    sequences: Tensor  # [4, S] int32: starts, ends, block-table rows, first positions
    blocks: Tensor  # [2, B] int32: each program's sequence and first token
    block_q: int


def varlen_table(
    lengths: list[int],
    rows: list[int],
    pos0: list[int] | None,
    group: int,
    device,
    *,
    programs: int | None = None,
    sequences: int | None = None,
) -> VarlenTable:
    """The table of len(lengths) sequences of lengths[s] tokens packed one after another,
    sequence s at positions pos0[s] .. (default 0) of block-table row rows[s], for programs
    of block_size(group) tokens. programs / sequences: pad the table to that many programs
    and sequences (a CUDA graph's fixed grid: programs_for(tokens, sequences) holds any
    table of those), the padding programs taking an empty sequence, which reads and writes
    nothing."""
    pos0 = [0] * len(lengths) if pos0 is None else pos0
    if len(rows) != len(lengths) or len(pos0) != len(lengths):
        raise ValueError(f"varlen_table: lengths {lengths}, rows {rows}, pos0 {pos0}")
    bq = block_size(group)
    starts, block_seq, block_tok, at = [], [], [], 0
    for s, n in enumerate(lengths):
        starts.append(at)
        for t in range(at, at + n, bq):
            block_seq.append(s)
            block_tok.append(t)
        at += n
    ends = [a + n for a, n in zip(starts, lengths)]
    padded = [starts, ends, rows, pos0]
    if sequences is not None or programs is not None:
        sequences = len(lengths) + 1 if sequences is None else sequences
        programs = len(block_seq) if programs is None else programs
        if sequences <= len(lengths) or programs < len(block_seq):
            raise ValueError(f"varlen_table: {len(lengths)} sequences in {len(block_seq)} "
                             f"programs do not fit a table of {sequences} sequences (one "
                             f"empty) and {programs} programs")  # fmt: skip
        empty = len(lengths)  # start = end = 0: no token
        padded = [column + [0] * (sequences - len(lengths)) for column in padded]
        block_seq += [empty] * (programs - len(block_seq))
        block_tok += [0] * (programs - len(block_tok))
    sequences_t = torch.tensor(padded, dtype=torch.int32).to(device)
    blocks = torch.tensor([block_seq, block_tok], dtype=torch.int32).to(device)
    return VarlenTable(at, sequences_t, blocks, bq)


def programs_for(tokens: int, sequences: int, group: int) -> int:
    """The most programs a table of `tokens` tokens in at most `sequences` sequences needs
    (each sequence's last block may be partial)."""
    return -(-tokens // block_size(group)) + sequences


def prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    table: VarlenTable,
    block_table: Tensor,
    scale: float = 1.0,
    window: int = 0,
    sinks: Tensor | None = None,
    chunk: int = 0,
) -> Tensor:
    """out [T, Hq, D] for q [T, Hq, D] packing the sequences `table` describes (built by
    varlen_table for this q's group of heads), paged caches k_cache / v_cache [NB, Hk, BS,
    D] already holding every position read, block_table [R, MB] int32 (sequence s reads
    its row rows[s]; R and MB cover every row and position read, not checked: they stay on
    the device). window > 0: position p sees p - window < j <= p (a sliding window);
    sinks [Hq]: one logit per head in each softmax's sum, with no value (gpt-oss); chunk >
    0: position p sees its own chunk's positions, p // chunk x chunk <= j <= p (Llama 4's
    chunked attention)."""
    check_sinks("prefill_attention", sinks, q.shape[1])
    tokens, q_heads, head_dim = q.shape
    kv_block_size = paged_block_size("prefill_attention", k_cache, v_cache, block_table)
    kv_heads = k_cache.shape[1]
    group = q_heads // kv_heads
    if table.tokens != tokens or table.block_q != block_size(group):
        raise ValueError(f"prefill_attention: a table of {table.tokens} tokens in blocks of "
                         f"{table.block_q} for q {tuple(q.shape)}")  # fmt: skip
    out = torch.empty_like(q)
    programs = table.blocks.shape[1]
    if programs:
        seq = table.sequences
        _prefill_attention_kernel[(programs, kv_heads)](
            q, k_cache, v_cache, block_table, out, table.blocks[0], table.blocks[1], seq[0],
            seq[1], seq[2], seq[3], out if sinks is None else sinks, scale, group, head_dim,
            kv_block_size, window, chunk, block_table.stride(0), q.stride(0), q.stride(1),
            *k_cache.stride()[:3], *v_cache.stride()[:3], out.stride(0), out.stride(1),
            BLOCK_Q=table.block_q, BLOCK_G=next_pow2(group), BLOCK_N=BLOCK_N,
            BLOCK_D=next_pow2(head_dim), IEEE=q.dtype == torch.float32,
            HAS_SINKS=sinks is not None, num_warps=WARPS,
        )  # fmt: skip
    return out
