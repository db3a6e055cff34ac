"""The decode step's own kernels (moelora/kernels: rms_norm, rope_cache, decode_attention,
dense_lora, router_topk) against outside truth: transformers' Qwen3-MoE RMSNorm, rotary
code and router, an fp64 softmax attention over each row's positions gathered through its
paged cache's block table (positions no row holds poisoned with NaN), and the per-token LoRA
delta of the module banks (itself checked against PEFT in the module tests). Fresh random
inputs per seed, outputs poisoned first; fp32 and fp16 (the interpreter's bf16 rounds by
its own rule)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm, apply_rotary_pos_emb

from moelora.compare import assert_close
from moelora.kernels.decode_attention import decode_attention, splits_for
from moelora.kernels.dense_linear import dense_linear, lora_shrink
from moelora.kernels.dense_lora import add_dense_lora
from moelora.kernels.prefill_attention import prefill_attention, programs_for, varlen_table
from moelora.kernels.rms_norm import add_rms_norm
from moelora.kernels.rope_cache import rope_and_cache
from moelora.kernels.router_topk import router_topk
from moelora.lora.module_banks import dense_lora_delta

DTYPES = [torch.float32, torch.float16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


NORMS = [
    # (id, rows, hidden, residual, transformers' norm): the edges each covers
    ("one-row-residual", 1, 64, True, "qwen3"),
    ("rows-no-residual", 5, 48, False, "qwen3"),  # hidden not a power of two: masked lanes
    ("wide", 3, 256, True, "qwen3"),
    ("gpt-oss-one-rounding", 4, 64, True, "gpt_oss"),  # weight x the fp32 row, then rounded
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", NORMS, ids=[c[0] for c in NORMS])
def test_add_rms_norm_equals_transformers(case, dtype, seed):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    _, rows, hidden, with_res, family = case
    g = _gen(seed)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    residual = torch.randn(rows, hidden, generator=g).to(dtype) if with_res else None
    norm = {"qwen3": Qwen3MoeRMSNorm, "gpt_oss": GptOssRMSNorm}[family](hidden, eps=1e-6)
    norm = norm.to(dtype)
    norm.weight.data = torch.randn(hidden, generator=g).to(dtype)
    s = x + residual if with_res else x  # transformers adds in the activation dtype
    ref = norm(s)
    out, out_sum = add_rms_norm(x, residual, norm.weight, 1e-6, family != "gpt_oss")
    assert_close(out, ref, dtype, what="y")
    assert torch.equal(out_sum, s)


ROPE = [
    # (id, rows, q heads, kv heads, head dim, norm): the edges each covers
    ("qwen3-like", 3, 8, 2, 16, True),
    ("no-norm-mha", 2, 4, 4, 32, False),
    ("one-row", 1, 4, 1, 16, True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ROPE, ids=[c[0] for c in ROPE])
def test_rope_and_cache_equal_transformers(case, dtype, seed):
    _, rows, hq, hk, d, with_norm = case
    g = _gen(seed)
    q = torch.randn(rows, hq * d, generator=g).to(dtype)
    k = torch.randn(rows, hk * d, generator=g).to(dtype)
    v = torch.randn(rows, hk * d, generator=g).to(dtype)
    angles = torch.rand(rows, d // 2, generator=g) * 6.0
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)  # as the rotary module returns them
    q_norm = Qwen3MoeRMSNorm(d).to(dtype) if with_norm else None
    k_norm = Qwen3MoeRMSNorm(d).to(dtype) if with_norm else None
    if q_norm is not None:
        q_norm.weight.data = torch.randn(d, generator=g).to(dtype)
        k_norm.weight.data = torch.randn(d, generator=g).to(dtype)
    cache_rows, cache_len = rows + 2, 10
    k_cache = torch.full((cache_rows, hk, cache_len, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    dest = torch.randperm(cache_rows, generator=g)[:rows]
    pos = torch.randint(0, cache_len, (rows,), generator=g)
    out = rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, dest, pos,
                         None if q_norm is None else q_norm.weight,
                         None if k_norm is None else k_norm.weight, 1e-6)  # fmt: skip
    # transformers: [B, heads, S=1, D] with cos / sin [B, S, D]
    qh = q.view(rows, hq, d)
    kh = k.view(rows, hk, d)
    if q_norm is not None:
        qh, kh = q_norm(qh), k_norm(kh)
    ref_q, ref_k = apply_rotary_pos_emb(qh[:, :, None], kh[:, :, None], cos[:, None], sin[:, None])
    assert_close(out, ref_q[:, :, 0], dtype, what="q")
    assert_close(k_cache[dest, :, pos], ref_k[:, :, 0], dtype, what="k in the cache")
    assert torch.equal(v_cache[dest, :, pos], v.view(rows, hk, d))
    written = torch.zeros(cache_rows, cache_len, dtype=torch.bool)
    written[dest, pos] = True
    assert k_cache.isnan().all(dim=(1, 3))[~written].all()  # nothing else was touched


FAMILY_ROPES = [
    "qwen3.5-partial-gated",
    "llama4-pairs-norm-after",
    "llama4-nope",
    "llama4-nope-temperature",
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", FAMILY_ROPES)
def test_rope_and_cache_family_forms_equal_transformers(form, dtype, seed):
    """Qwen3.5's full-attention heads (q interleaved with its output gate, zero-centered
    norms, rotary over the first half of each head) and Llama 4's (complex pairs in fp32,
    the weightless norm after; NoPE layers: neither, q times each position's attention
    temperature where the layer has it) against transformers' own functions."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextL2Norm, apply_rotary_emb
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen35

    rows, hq, hk, d = 3, 4, 2, 16
    g = _gen(seed)
    gated = form.startswith("qwen3.5")
    q = torch.randn(rows, hq * d * (2 if gated else 1), generator=g).to(dtype)
    k, v = (torch.randn(rows, hk * d, generator=g).to(dtype) for _ in range(2))
    k_cache = torch.full((rows + 2, hk, 10, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    dest = torch.randperm(rows + 2, generator=g)[:rows]
    pos = torch.randint(0, 10, (rows,), generator=g)
    qh, kh = q.view(rows, hq, -1)[..., :d], k.view(rows, hk, d)
    if gated:
        angles = torch.rand(rows, d // 4, generator=g) * 6.0
        emb = torch.cat([angles, angles], dim=-1)  # rotary over the first d / 2
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        norms = [qwen35.Qwen3_5MoeRMSNorm(d, eps=1e-6).to(dtype) for _ in range(2)]
        for n in norms:
            n.weight.data = (torch.randn(d, generator=g) * 0.5).to(dtype)
        out = rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, dest, pos,
                             *(1.0 + n.weight.float() for n in norms), 1e-6,
                             round_normed=False, head_dim=d, q_head_stride=2 * d)  # fmt: skip
        ref_q, ref_k = qwen35.apply_rotary_pos_emb(norms[0](qh)[:, :, None],
                                                   norms[1](kh)[:, :, None], cos[:, None],
                                                   sin[:, None])  # fmt: skip
        ref_q, ref_k = ref_q[:, :, 0], ref_k[:, :, 0]
    else:
        angles = torch.rand(rows, d // 2, generator=g) * 6.0
        freqs = torch.polar(torch.ones_like(angles), angles)
        nope = "nope" in form
        scale = None
        if form.endswith("temperature"):  # Llama4TextAttention's attn_scales
            positions = torch.randint(0, 100, (rows,), generator=g).float()
            scale = torch.log1p(torch.floor((positions + 1.0) / 4.0)) * 0.1 + 1.0
        out = rope_and_cache(q, k, v, freqs.real, freqs.imag, k_cache, v_cache, dest, pos,
                             eps=1e-5, norm="none" if nope else "after",
                             rope="none" if nope else "pairs", head_dim=d, q_scale=scale)  # fmt: skip
        if nope:
            ref_q, ref_k = qh, kh
            if scale is not None:
                ref_q = (qh * scale[:, None, None]).to(dtype)
        else:  # transformers: [B, S=1, heads, D] with freqs [B, S, D / 2]
            ref_q, ref_k = apply_rotary_emb(qh[:, None], kh[:, None], freqs[:, None])
            norm = Llama4TextL2Norm(eps=1e-5)
            ref_q, ref_k = norm(ref_q[:, 0]), norm(ref_k[:, 0])
    assert_close(out, ref_q, dtype, what="q")
    assert_close(k_cache[dest, :, pos], ref_k, dtype, what="k in the cache")
    assert torch.equal(v_cache[dest, :, pos], v.view(rows, hk, d))
    written = torch.zeros(rows + 2, 10, dtype=torch.bool)
    written[dest, pos] = True
    assert k_cache.isnan().all(dim=(1, 3))[~written].all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", ["v3-deinterleaved", "v3-halves", "v2-complex"])
def test_rope_and_cache_deepseek_forms_equal_transformers(form, dtype, seed):
    """DeepSeek's rotary parts: q's last `rope` of each head (read in place from the q_b
    output, after each head's nope part) and the shared key written into the latent cache's
    rotary columns (no values), against transformers' apply_rotary_pos_emb_interleave (V3
    with rope_interleave), apply_rotary_pos_emb (without) and DeepSeek-V2's apply_rotary_emb."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    rows, heads, nope, rope, rank = 3, 4, 8, 16, 24
    g = _gen(seed)
    q = torch.randn(rows, heads * (nope + rope), generator=g).to(dtype)
    ckv = torch.randn(rows, rank + rope, generator=g).to(dtype)
    cache = torch.full((rows + 2, 1, 6, rank + rope), float("nan"), dtype=dtype)
    dest = torch.randperm(rows + 2, generator=g)[:rows]
    pos = torch.randint(0, 6, (rows,), generator=g)
    q_rot, k_rot = q.view(rows, heads, -1)[..., nope:], ckv[:, None, rank:]
    angles = torch.rand(rows, rope // 2, generator=g) * 6.0
    if form == "v2-complex":
        freqs = torch.polar(torch.ones_like(angles), angles)
        cos, sin, layout = freqs.real, freqs.imag, "pairs"
        ref_q, ref_k = v2.apply_rotary_emb(q_rot[:, None], k_rot[:, None], freqs[:, None])
        ref_q, ref_k = ref_q[:, 0], ref_k[:, 0]
    else:
        emb = torch.cat([angles, angles], dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        layout = "deinterleaved" if form == "v3-deinterleaved" else "halves"
        apply = v3.apply_rotary_pos_emb_interleave if layout == "deinterleaved" else (
            v3.apply_rotary_pos_emb)  # fmt: skip
        ref_q, ref_k = apply(q_rot[:, :, None], k_rot[:, :, None], cos[:, None], sin[:, None])
        ref_q, ref_k = ref_q[:, :, 0], ref_k[:, :, 0]
    out = rope_and_cache(q[:, nope:], ckv[:, rank:], None, cos, sin, cache[..., rank:], None,
                         dest, pos, rope=layout, head_dim=rope, q_head_stride=nope + rope,
                         q_heads=heads)  # fmt: skip
    assert_close(out, ref_q, dtype, what="q")
    assert_close(cache[dest, :, pos, rank:], ref_k, dtype, what="k in the cache")
    assert cache[..., :rank].isnan().all()  # the latent's columns are written apart
    written = torch.zeros(rows + 2, 6, dtype=torch.bool)
    written[dest, pos] = True
    assert cache[..., rank:].isnan().all(dim=(1, 3))[~written].all()


def _paged_cache(
    lengths: list[int],
    hk: int,
    d: int,
    bs: int,
    share: tuple[int, int, int] | None,
    dtype: torch.dtype,
    g: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Paged caches k / v [NB, Hk, BS, D] and block_table [R, MB] int32 for R = len(lengths)
    rows, row r holding positions 0 .. lengths[r] - 1 in blocks drawn from a random
    permutation of the ids (in no set order, seldom adjacent); share = (a, b, n):
    row b's first n blocks are row a's (a shared prefix). Every position no row holds is
    NaN, whole spare blocks included, and table entries past a row's blocks name a spare
    block: a kernel reading anything it should not returns NaN."""
    need = [math.ceil(n / bs) for n in lengths]
    shared = share[2] if share else 0
    num_blocks = sum(need) - shared + 2  # two spare blocks, never any row's
    ids = torch.randperm(num_blocks, generator=g).tolist()
    spare = ids.pop()
    table = torch.full((len(lengths), max(1, *need)), spare, dtype=torch.int32)
    for r, k in enumerate(need):
        take = shared if share and r == share[1] else 0
        if take:
            table[r, :take] = table[share[0], :take]
        table[r, take:k] = torch.tensor([ids.pop() for _ in range(k - take)], dtype=torch.int32)
    held = torch.zeros(num_blocks, bs, dtype=torch.bool)
    for r, n in enumerate(lengths):
        pos = torch.arange(n)
        held[table[r, pos // bs].long(), pos % bs] = True
    caches = []
    for _ in range(2):
        data = torch.randn(num_blocks, hk, bs, d, generator=g)
        caches.append(data.masked_fill(~held[:, None, :, None], float("nan")).to(dtype))
    return caches[0], caches[1], table


def _gather(cache: torch.Tensor, block_table: torch.Tensor, row: int, n: int) -> torch.Tensor:
    """Positions 0 .. n - 1 of block-table row `row`, dense: [Hk, n, D]."""
    pos = torch.arange(n)
    bs = cache.shape[2]
    return cache[block_table[row, pos // bs].long(), :, pos % bs].transpose(0, 1)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
            sinks: torch.Tensor | None = None):  # fmt: skip
    """fp64 softmax attention of q [Hq, D] over keys / values [Hk, n, D] (Hq / Hk query
    heads per KV head): [Hq, D]; sinks [Hq]: a logit per head in the softmax, its
    probability dropped (transformers' gpt-oss eager attention)."""
    group = q.shape[0] // keys.shape[0]
    keys = keys.double().repeat_interleave(group, dim=0)
    values = values.double().repeat_interleave(group, dim=0)
    scores = torch.einsum("hd,hnd->hn", q.double(), keys) * scale
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
    probs = torch.softmax(scores, dim=-1)[:, : keys.shape[1]]
    return torch.einsum("hn,hnd->hd", probs, values)


ATTENTION = [
    # (id, rows, q heads, kv heads, head dim, block size, positions, max_len, shared blocks)
    ("gqa-one-split", 2, 8, 2, 16, 16, 40, 40, 0),
    ("gqa-splits-bs5", 3, 8, 2, 16, 5, 300, 300, 0),  # 8 splits over 60 blocks of 5 each
    ("mha-bs24-default-max-len", 2, 4, 4, 32, 24, 70, None, 0),  # max_len: MB x BS = 72
    ("group-of-one-bs128", 1, 4, 1, 16, 128, 130, 130, 0),  # 4 splits inside 128-blocks
    ("shared-prefix", 3, 8, 2, 16, 16, 100, 100, 2),  # rows 0 and 2 share 2 blocks
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ATTENTION, ids=[c[0] for c in ATTENTION])
def test_decode_attention_equals_softmax_attention(case, dtype, seed):
    """Each row against an fp64 softmax over its positions gathered through the block
    table; rows of every length from 1 to `positions`, the last of them sharing row 0's
    first blocks where the case says so."""
    name, rows, hq, hk, d, bs, positions, max_len, shared = case
    g = _gen(seed)
    lengths = torch.randint(1, positions + 1, (rows,), generator=g)
    lengths[0] = positions  # a full row, and a one-key row where there is room
    if rows > 1:
        lengths[1] = 1
    if shared:
        lengths[-1] = int(torch.randint(shared * bs + 1, positions + 1, (1,), generator=g))
    share = (0, rows - 1, shared) if shared else None
    # one table row more than q has: it is never read
    k_cache, v_cache, block_table = _paged_cache([*lengths.tolist(), 0], hk, d, bs, share,
                                                 dtype, g)  # fmt: skip
    q = torch.randn(rows, hq, d, generator=g).to(dtype)
    scale = d**-0.5
    out = decode_attention(q, k_cache, v_cache, block_table, lengths, scale, max_len)
    ref = torch.empty(rows, hq, d, dtype=torch.float64)
    for t in range(rows):
        n = int(lengths[t])
        keys, values = (_gather(c, block_table, t, n) for c in (k_cache, v_cache))
        ref[t] = _attend(q[t], keys, values, scale)
    assert_close(out, ref, dtype, what="attention")
    if "splits" in name or "bs128" in name:  # the case covers the combine kernel
        assert splits_for(rows, hk, max_len) > 1


PREFILLS = [
    # (id, q heads, kv heads, head dim, block size, [(length, table row, first position)],
    #  shared blocks (row a, row b, n)): the edges each covers
    ("gqa-varlen", 8, 2, 16, 16, [(5, 2, 0), (37, 0, 0), (1, 3, 0)], None),  # a 1-token one
    ("prefix-in-cache-bs5", 4, 4, 32, 5, [(20, 1, 70), (9, 0, 3)], None),  # chunks after a
    # cached prefix, BS neither a power of two nor a divisor of BLOCK_N
    ("one-long-group-of-one-bs128", 4, 1, 16, 128, [(150, 0, 0)], None),  # BS >= BLOCK_N;
    # several key tiles, several q blocks
    ("shared-prefix-bs24", 8, 2, 16, 24, [(30, 0, 50), (10, 1, 48)], (0, 1, 2)),  # two
    # chunks after one cached 48-position prefix (two shared blocks)
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PREFILLS, ids=[c[0] for c in PREFILLS])
def test_prefill_attention_equals_causal_softmax_attention(case, dtype, seed):
    """Each packed token against an fp64 softmax over its block-table row's positions
    0 .. its own, gathered through the table; every position no row holds is NaN."""
    _, hq, hk, d, bs, seqs, share = case
    g = _gen(seed)
    lengths = [n for n, _, _ in seqs]
    rows = [r for _, r, _ in seqs]
    pos0 = [p for _, _, p in seqs]
    held = [0] * 4  # four table rows, those no sequence reads empty
    for n, r, p in seqs:
        held[r] = p + n
    k_cache, v_cache, block_table = _paged_cache(held, hk, d, bs, share, dtype, g)
    q = torch.randn(sum(lengths), hq, d, generator=g).to(dtype)
    scale = d**-0.5
    table = varlen_table(lengths, rows, pos0, hq // hk, q.device)
    out = prefill_attention(q, k_cache, v_cache, table, block_table, scale)
    ref = torch.empty(q.shape, dtype=torch.float64)
    t = 0
    for n, r, p in seqs:
        keys, values = (_gather(c, block_table, r, p + n) for c in (k_cache, v_cache))
        for i in range(n):
            ref[t] = _attend(q[t], keys[:, : p + i + 1], values[:, : p + i + 1], scale)
            t += 1
    assert not out.isnan().any()
    assert_close(out, ref, dtype, what="prefill attention")


@pytest.mark.parametrize("case", PREFILLS[:2], ids=[c[0] for c in PREFILLS[:2]])
def test_a_padded_varlen_table_gives_the_same_attention(case, seed):
    """A table padded to a fixed grid (a CUDA graph's: programs_for's programs, spare
    sequences) gives every token the attention the exact table gives, bit for bit: the
    padding programs take the empty sequence and write nothing; a grid too small is
    refused."""
    _, hq, hk, d, bs, seqs, share = case
    g = _gen(seed)
    lengths, rows, pos0 = ([s[i] for s in seqs] for i in range(3))
    held = [0] * 4
    for n, r, p in seqs:
        held[r] = p + n
    k_cache, v_cache, block_table = _paged_cache(held, hk, d, bs, share, torch.float32, g)
    q = torch.randn(sum(lengths), hq, d, generator=g)
    exact = prefill_attention(q, k_cache, v_cache, varlen_table(lengths, rows, pos0, hq // hk,
                              q.device), block_table, d**-0.5)  # fmt: skip
    spare = len(seqs) + 3
    programs = programs_for(sum(lengths), spare, hq // hk)
    padded = varlen_table(lengths, rows, pos0, hq // hk, q.device, programs=programs,
                          sequences=spare)  # fmt: skip
    assert padded.blocks.shape == (2, programs) and padded.sequences.shape == (4, spare)
    out = prefill_attention(q, k_cache, v_cache, padded, block_table, d**-0.5)
    assert torch.equal(out, exact)
    with pytest.raises(ValueError, match="do not fit"):
        varlen_table(lengths, rows, pos0, hq // hk, q.device, programs=1, sequences=spare)
    with pytest.raises(ValueError, match="do not fit"):
        varlen_table(lengths, rows, pos0, hq // hk, q.device, sequences=len(seqs))


WINDOWS = [
    # (id, rows, q heads, kv heads, head dim, block size, positions, window, sinks, chunk):
    # the edges each covers (gpt-oss: sliding windows on half its layers, sinks on every one;
    # Llama 4: chunked attention on its rotary layers)
    ("splits-below-the-window", 3, 8, 2, 16, 5, 300, 37, True, 0),  # whole splits skipped
    ("one-split", 2, 4, 2, 16, 16, 40, 7, True, 0),
    ("window-past-the-length", 2, 4, 1, 16, 16, 50, 500, True, 0),  # every position
    ("sinks-alone", 2, 8, 2, 16, 16, 90, 0, True, 0),
    ("window-alone", 2, 8, 2, 32, 24, 130, 50, False, 0),
    ("splits-below-the-chunk", 4, 8, 2, 16, 5, 300, 0, False, 70),  # chunks not on splits
    ("chunk-past-the-length", 2, 4, 1, 16, 16, 50, 0, False, 500),
    ("chunk-of-one-block-and-window", 3, 4, 2, 16, 8, 100, 5, True, 8),  # both limits
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", WINDOWS, ids=[c[0] for c in WINDOWS])
def test_decode_attention_with_a_window_and_sinks(case, dtype, seed):
    """Each row against an fp64 softmax over its last `window` positions (0: all) with a
    sink logit per head, at the lengths the splits cut differently."""
    _, rows, hq, hk, d, bs, positions, window, has_sinks, chunk = case
    g = _gen(seed)
    lengths = torch.randint(1, positions + 1, (rows,), generator=g)
    lengths[0] = positions
    if chunk and rows > 2:  # a row on its chunk's first position, one on its last
        lengths[1], lengths[2] = chunk * (positions // chunk - 1) + 1, chunk
    k_cache, v_cache, block_table = _paged_cache(lengths.tolist(), hk, d, bs, None, dtype, g)
    q = torch.randn(rows, hq, d, generator=g).to(dtype)
    sinks = torch.randn(hq, generator=g).to(dtype) if has_sinks else None
    scale = d**-0.5
    out = decode_attention(q, k_cache, v_cache, block_table, lengths, scale, positions,
                           window=window, sinks=sinks, chunk=chunk)  # fmt: skip
    ref = torch.empty(rows, hq, d, dtype=torch.float64)
    for t in range(rows):
        n = int(lengths[t])
        first = max(0, n - window) if window else 0
        if chunk:
            first = max(first, (n - 1) // chunk * chunk)
        keys, values = (_gather(c, block_table, t, n)[:, first:] for c in (k_cache, v_cache))
        ref[t] = _attend(q[t], keys, values, scale, sinks)
    assert_close(out, ref, dtype, what="attention")
    if "splits" in _:
        assert splits_for(rows, hk, positions) > 1


PREFILL_WINDOWS = [
    # (id, q heads, kv heads, head dim, block size, [(length, table row, first position)],
    #  window, sinks, chunk)
    ("varlen-window-4", 8, 2, 16, 16, [(5, 2, 0), (37, 0, 0), (1, 3, 0)], 4, True, 0),
    ("chunk-after-prefix-window-13", 4, 4, 32, 5, [(20, 1, 70), (9, 0, 3)], 13, True, 0),
    ("long-window-70-many-tiles", 4, 1, 16, 128, [(150, 0, 0)], 70, False, 0),  # the first
    # key tile of a q block starts mid-tile
    ("sinks-alone", 8, 2, 16, 16, [(30, 0, 10)], 0, True, 0),
    ("group-of-one-150-window-4", 2, 2, 16, 16, [(150, 0, 0)], 4, True, 0),  # q blocks of 128
    # tokens over key tiles of 64: rows past 64 see no key of the block's first tile
    ("varlen-chunk-8", 8, 2, 16, 16, [(5, 2, 0), (37, 0, 0), (1, 3, 8)], 0, False, 8),
    ("chunk-after-prefix-not-aligned", 4, 4, 32, 5, [(20, 1, 70), (9, 0, 3)], 0, True, 16),
    ("group-of-one-150-chunk-100", 2, 2, 16, 16, [(150, 0, 0)], 0, False, 100),  # a q block
    # across a chunk's end: its rows start at 0 or 100
    ("chunk-and-window", 4, 2, 16, 16, [(60, 0, 0)], 9, False, 16),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PREFILL_WINDOWS, ids=[c[0] for c in PREFILL_WINDOWS])
def test_prefill_attention_with_a_window_and_sinks(case, dtype, seed):
    """Each packed token against an fp64 softmax over the positions of its window up to its
    own, with a sink logit per head."""
    _, hq, hk, d, bs, seqs, window, has_sinks, chunk = case
    g = _gen(seed)
    held = [0] * 4
    for n, r, p in seqs:
        held[r] = p + n
    k_cache, v_cache, block_table = _paged_cache(held, hk, d, bs, None, dtype, g)
    lengths = [n for n, _, _ in seqs]
    q = torch.randn(sum(lengths), hq, d, generator=g).to(dtype)
    sinks = torch.randn(hq, generator=g).to(dtype) if has_sinks else None
    scale = d**-0.5
    table = varlen_table(lengths, [r for _, r, _ in seqs], [p for _, _, p in seqs], hq // hk,
                         q.device)  # fmt: skip
    out = prefill_attention(q, k_cache, v_cache, table, block_table, scale, window, sinks,
                            chunk)  # fmt: skip
    ref = torch.empty(q.shape, dtype=torch.float64)
    t = 0
    for n, r, p in seqs:
        keys, values = (_gather(c, block_table, r, p + n) for c in (k_cache, v_cache))
        for i in range(n):
            first = max(0, p + i + 1 - window) if window else 0
            if chunk:
                first = max(first, (p + i) // chunk * chunk)
            ref[t] = _attend(q[t], keys[:, first : p + i + 1], values[:, first : p + i + 1],
                             scale, sinks)  # fmt: skip
            t += 1
    assert not out.isnan().any()
    assert_close(out, ref, dtype, what="prefill attention")


REFUSALS = [
    # (id, what breaks the paged layout, the field the error names)
    ("table-int64", lambda k, v, bt: (k, v, bt.long()), "block_table"),
    ("table-not-contiguous", lambda k, v, bt: (k, v, bt.repeat(1, 2)[:, ::2]), "block_table"),
    ("v-shape", lambda k, v, bt: (k, v[:, :, :-1], bt), "v_cache"),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_paged_attention_refuses_a_broken_layout(case):
    """Both launchers refuse (ValueError naming the field) a cache or table that does not
    fit the paged layout, before anything runs."""
    _, broken, field = case
    k, v, bt = _paged_cache([3, 5], 1, 16, 4, None, torch.float32, _gen(0))
    k, v, bt = broken(k, v, bt)
    q = torch.randn(2, 2, 16)
    with pytest.raises(ValueError, match=field):
        decode_attention(q, k, v, bt, torch.tensor([3, 5]), 1.0)
    table = varlen_table([2, 3], [0, 1], [1, 2], 2, q.device)
    with pytest.raises(ValueError, match=field):
        prefill_attention(torch.randn(5, 2, 16), k, v, table, bt)


LORA = [
    # (id, tokens, slots, rank, in, out, slots used): the edges each covers
    ("mixed-with-base", 5, 4, 8, 48, 40, [0, -1, 3, 0, 2]),
    ("all-base", 3, 2, 4, 32, 16, [-1, -1, -1]),  # no adapter: out unchanged, exactly
    ("wide-out", 2, 3, 16, 64, 600, [2, 1]),  # several column blocks
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", LORA, ids=[c[0] for c in LORA])
def test_dense_lora_equals_the_bank_delta(case, dtype, seed):
    _, tokens, num_slots, rank, n, m, used = case
    g = _gen(seed)
    x = torch.randn(tokens, n, generator=g).to(dtype)
    a = (torch.randn(num_slots, rank, n, generator=g) / math.sqrt(n)).to(dtype)
    bt = torch.randn(num_slots, rank, m, generator=g).to(dtype)
    a[1, rank // 2 :] = 0  # slot 1 holds a lower-rank adapter (its rows past r are zero)
    bt[1, rank // 2 :] = 0
    slots = torch.tensor(used, dtype=torch.int32)
    base = torch.randn(tokens, m, generator=g).to(dtype)
    out = add_dense_lora(base.clone(), x, slots, a, bt)
    ref = base + dense_lora_delta(x, slots, a, bt).to(dtype)
    assert_close(out, ref, dtype, what="out")
    plain = slots < 0
    assert torch.equal(out[plain], base[plain])  # slot -1 rows: untouched


ROUTERS = [
    # (id, family, tokens, experts, top_k, hidden, renorm): the edges each covers
    ("qwen3-like", "qwen3_moe", 4, 16, 4, 64, True),
    ("no-renorm-odd-experts", "qwen3_moe", 3, 12, 2, 48, False),  # E not a power of two
    ("one-token-top1", "qwen3_moe", 1, 8, 1, 32, True),
    ("mixtral-fp32-weights", "mixtral", 5, 8, 2, 64, True),  # weights not rounded to dtype
]


def _router(family: str, experts: int, top_k: int, hidden: int, renorm: bool):
    """transformers' router of `family` (its weights left to the caller)."""
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

        config = MixtralConfig(num_local_experts=experts, num_experts_per_tok=top_k,
                               hidden_size=hidden)  # fmt: skip
        return MixtralTopKRouter(config)
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(num_experts=experts, num_experts_per_tok=top_k, hidden_size=hidden,
                            norm_topk_prob=renorm)  # fmt: skip
    return Qwen3MoeTopKRouter(config)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ROUTERS, ids=[c[0] for c in ROUTERS])
def test_router_topk_equals_transformers(case, dtype, seed):
    _, family, tokens, experts, top_k, hidden, renorm = case
    g = _gen(seed)
    router = _router(family, experts, top_k, hidden, renorm).to(dtype)
    router.weight.data = torch.randn(experts, hidden, generator=g).to(dtype) / math.sqrt(hidden)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    _, ref_w, ref_ids = router(x)
    round_weights = ref_w.dtype == dtype  # Mixtral's stay fp32
    logits = torch.nn.functional.linear(x, router.weight)
    weights, ids = router_topk(logits, top_k, renorm, round_weights)
    # Equal ids, except among experts of exactly equal logits (fp16 rounds 1 in ~40 draws of
    # this case into a tie), whose order torch.topk leaves unspecified: there the kernel's
    # pick must carry the same logit as transformers' and no expert may repeat.
    probs = torch.softmax(logits.float(), dim=-1)
    assert torch.equal(probs.gather(1, ids.long()), probs.gather(1, ref_ids)), (ids, ref_ids)
    assert all(len(set(row)) == top_k for row in ids.tolist()), ids
    if round_weights or dtype == torch.float32:
        assert_close(weights, ref_w.float(), dtype, what="weights")
    else:  # fp32 weights from fp16 logits: held to fp32's tolerance, not fp16's
        assert_close(weights, ref_w, torch.float32, what="weights")


LINEARS = [
    # (id, tokens, in features, out features per module, LoRA per module, bias, slots)
    ("qkv-one-row", 1, 96, (72, 24, 24), (True, False, True), False, [2]),
    ("qkv-mixed-rows", 5, 200, (72, 24, 24), (True, True, False), True, [0, -1, 2, 2, 1]),
    ("o-alone-many-rows", 37, 64, (96,), (True,), False, [i % 4 - 1 for i in range(37)]),
    ("lora-free", 3, 64, (40, 24), (False, False), False, [0, 1, 2]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", LINEARS, ids=[c[0] for c in LINEARS])
def test_dense_linear_equals_linear_plus_bank_delta(case, dtype, seed):
    """Each module's output: F.linear plus its rows' LoRA delta (module_banks'), the
    modules read in one launch, slot -1 rows and modules without LoRA the base alone."""
    _, tokens, n, widths, lora, with_bias, used = case
    g = _gen(seed)
    num_slots, rank = 3, 8
    x = torch.randn(tokens, n, generator=g).to(dtype)
    weights = [(torch.randn(m, n, generator=g) / math.sqrt(n)).to(dtype) for m in widths]
    biases = [torch.randn(m, generator=g).to(dtype) if with_bias else None for m in widths]
    a = [(torch.randn(num_slots, rank, n, generator=g) / math.sqrt(n)).to(dtype) if on else None
         for on in lora]  # fmt: skip
    bt = [torch.randn(num_slots, rank, m, generator=g).to(dtype) if on else None
          for m, on in zip(widths, lora)]  # fmt: skip
    for ak, bk in zip(a, bt):
        if ak is not None:  # slot 1 holds a lower-rank adapter (its rows past r are zero)
            ak[1, rank // 2 :] = 0
            bk[1, rank // 2 :] = 0
    slots = torch.tensor(used, dtype=torch.int32)
    z = lora_shrink(x, slots, a) if any(lora) else None
    outs = dense_linear(x, weights, biases, slots, z, bt)
    for k, (out, w, b) in enumerate(zip(outs, weights, biases)):
        base = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        ref = base.to(dtype)
        if a[k] is not None:
            ref = ref + dense_lora_delta(x, slots, a[k], bt[k]).to(dtype)
        assert out.shape == (tokens, w.shape[0]) and not out.isnan().any()
        assert_close(out, ref, dtype, what=f"module {k}")
