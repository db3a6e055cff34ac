"""DeepSeek's latent attention over the paged latent cache (kernels/mla_attention.py), decode
and varlen prefill, against an fp64 softmax over each token's positions gathered through the
block table: scores q . [c, k_r] over the whole width, the output the probabilities times
the latents c. Every position no row holds is NaN (a kernel reading anything it should not
returns NaN); ranks and rotary widths that are not powers of two, heads that are not a
multiple of the kernel's head block, block sizes that do not divide its position tile."""

from __future__ import annotations

import pytest
import torch
from test_decode_kernels import _gather, _paged_cache

from moelora.compare import assert_close
from moelora.kernels.decode_attention import splits_for
from moelora.kernels.mla_attention import (
    mla_decode_attention,
    mla_prefill_attention,
)
from moelora.kernels.prefill_attention import programs_for, varlen_table

DTYPES = [torch.float32, torch.float16]


def _attend(q: torch.Tensor, latents: torch.Tensor, rank: int, scale: float) -> torch.Tensor:
    """fp64 attention of q [H, W] over the positions' [c, k_r] rows latents [n, W]: [H, rank]."""
    scores = q.double() @ latents.double().T * scale
    return torch.softmax(scores, dim=-1) @ latents.double()[:, :rank]


DECODES = [
    # (id, rows, heads, rank, rope, block size, positions, max_len, shared blocks)
    ("one-split-heads16", 3, 16, 64, 16, 16, 60, 60, 0),
    ("splits-bs5-heads4", 3, 4, 32, 8, 5, 300, 300, 0),  # 4 heads in a block of 16
    ("rank24-heads20-bs128", 2, 20, 24, 12, 128, 150, None, 0),  # two head blocks, masked
    # widths; max_len MB x BS
    ("shared-prefix", 3, 16, 32, 16, 16, 100, 100, 2),  # rows 0 and 2 share two blocks
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DECODES, ids=[c[0] for c in DECODES])
def test_mla_decode_attention_equals_softmax_attention(case, dtype, seed):
    name, rows, heads, rank, rope, bs, positions, max_len, shared = case
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, positions + 1, (rows,), generator=g)
    lengths[0], lengths[1] = positions, 1  # a full row and a one-position row
    if shared:
        lengths[-1] = int(torch.randint(shared * bs + 1, positions + 1, (1,), generator=g))
    share = (0, rows - 1, shared) if shared else None
    cache, _, block_table = _paged_cache([*lengths.tolist(), 0], 1, rank + rope, bs, share,
                                         dtype, g)  # fmt: skip
    q = torch.randn(rows, heads, rank + rope, generator=g).to(dtype)
    scale = (rank + rope) ** -0.5
    out = mla_decode_attention(q, cache, block_table, lengths, scale, rank, max_len)
    assert out.shape == (rows, heads, rank) and not out.isnan().any()
    ref = torch.stack([_attend(q[t], _gather(cache, block_table, t, int(lengths[t]))[0], rank,
                               scale) for t in range(rows)])  # fmt: skip
    assert_close(out, ref, dtype, what="latent attention")
    if "splits" in name or "bs128" in name:  # the case covers the combine kernel
        heads_blocks = -(-heads // 16)
        assert splits_for(rows, heads_blocks, max_len or block_table.shape[1] * bs) > 1


PREFILLS = [
    # (id, heads, rank, rope, block size, [(length, table row, first position)], shared)
    ("varlen-heads16", 16, 32, 16, 16, [(5, 2, 0), (37, 0, 0), (1, 3, 0)], None),
    ("prefix-in-cache-bs5-heads4", 4, 24, 8, 5, [(20, 1, 70), (9, 0, 3)], None),
    ("heads20-bs128", 20, 32, 16, 128, [(150, 0, 0)], None),  # several tiles and blocks
    ("shared-prefix-bs24", 16, 32, 16, 24, [(30, 0, 50), (10, 1, 48)], (0, 1, 2)),
]


def _prefill_case(case, dtype, seed):
    _, heads, rank, rope, bs, seqs, share = case
    g = torch.Generator().manual_seed(seed)
    held = [0] * 4  # four table rows, those no sequence reads empty
    for n, r, p in seqs:
        held[r] = p + n
    cache, _, block_table = _paged_cache(held, 1, rank + rope, bs, share, dtype, g)
    q = torch.randn(sum(n for n, _, _ in seqs), heads, rank + rope, generator=g).to(dtype)
    return heads, rank, rope, seqs, cache, block_table, q


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PREFILLS, ids=[c[0] for c in PREFILLS])
def test_mla_prefill_attention_equals_causal_softmax_attention(case, dtype, seed):
    heads, rank, rope, seqs, cache, block_table, q = _prefill_case(case, dtype, seed)
    lengths, rows, pos0 = ([s[i] for s in seqs] for i in range(3))
    scale = (rank + rope) ** -0.5
    table = varlen_table(lengths, rows, pos0, heads, q.device)
    out = mla_prefill_attention(q, cache, table, block_table, scale, rank)
    assert out.shape == (q.shape[0], heads, rank) and not out.isnan().any()
    ref, t = torch.empty(out.shape, dtype=torch.float64), 0
    for n, r, p in seqs:
        latents = _gather(cache, block_table, r, p + n)[0]
        for i in range(n):
            ref[t] = _attend(q[t], latents[: p + i + 1], rank, scale)
            t += 1
    assert_close(out, ref, dtype, what="latent prefill attention")


def test_a_padded_table_gives_the_same_latent_attention(seed):
    """A table padded to a CUDA graph's fixed grid gives every token the same output, bit for
    bit (the padding programs take the empty sequence and write nothing)."""
    heads, rank, _, seqs, cache, block_table, q = _prefill_case(PREFILLS[1], torch.float32,
                                                                   seed)  # fmt: skip
    lengths, rows, pos0 = ([s[i] for s in seqs] for i in range(3))
    exact = mla_prefill_attention(q, cache, varlen_table(lengths, rows, pos0, heads, q.device),
                                  block_table, 0.3, rank)  # fmt: skip
    spare = len(seqs) + 3
    padded = varlen_table(lengths, rows, pos0, heads, q.device,
                          programs=programs_for(sum(lengths), spare, heads), sequences=spare)  # fmt: skip
    assert torch.equal(mla_prefill_attention(q, cache, padded, block_table, 0.3, rank), exact)


def test_a_broken_layout_is_refused_by_name():
    cache = torch.randn(4, 1, 16, 40)
    table = torch.zeros(2, 3, dtype=torch.int32)
    q, lengths = torch.randn(2, 16, 40), torch.tensor([3, 5])
    with pytest.raises(ValueError, match=r"cache \(4, 2, 16, 40\)"):
        mla_decode_attention(q, torch.randn(4, 2, 16, 40), table, lengths, 1.0, 32)
    with pytest.raises(ValueError, match=r"q \(2, 16, 41\); expected \[T, H, 40\]"):
        mla_decode_attention(torch.randn(2, 16, 41), cache, table, lengths, 1.0, 32)
    with pytest.raises(ValueError, match="rank 40 for a cache of width 40"):
        mla_decode_attention(q, cache, table, lengths, 1.0, 40)
    with pytest.raises(ValueError, match=r"torch\.int64"):
        mla_decode_attention(q, cache, table.long(), lengths, 1.0, 32)
    with pytest.raises(ValueError, match="block_table has 1 rows for q of 2 rows"):
        mla_decode_attention(q, cache, table[:1], lengths, 1.0, 32)
    with pytest.raises(ValueError, match="group=16"):
        mla_prefill_attention(q, cache, varlen_table([2], [0], [0], 4, "cpu"), table, 1.0, 32)
