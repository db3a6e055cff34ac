"""The decode step's own kernels (moelora/kernels: rms_norm, rope_cache, decode_attention,
dense_lora, router_topk) against outside truth: transformers' Qwen3-MoE RMSNorm, rotary
code and router, an fp64 softmax attention over each row's length, and the per-token LoRA
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
from moelora.kernels.prefill_attention import prefill_attention, varlen_table
from moelora.kernels.rms_norm import add_rms_norm
from moelora.kernels.rope_cache import rope_and_cache
from moelora.kernels.router_topk import router_topk
from moelora.lora.module_banks import dense_lora_delta

DTYPES = [torch.float32, torch.float16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


NORMS = [
    # (id, rows, hidden, residual): the edges each covers
    ("one-row-residual", 1, 64, True),
    ("rows-no-residual", 5, 48, False),  # hidden not a power of two: masked lanes
    ("wide", 3, 256, True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", NORMS, ids=[c[0] for c in NORMS])
def test_add_rms_norm_equals_transformers(case, dtype, seed):
    _, rows, hidden, with_res = case
    g = _gen(seed)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    residual = torch.randn(rows, hidden, generator=g).to(dtype) if with_res else None
    norm = Qwen3MoeRMSNorm(hidden, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(hidden, generator=g).to(dtype)
    s = x + residual if with_res else x  # transformers adds in the activation dtype
    ref = norm(s)
    out, out_sum = add_rms_norm(x, residual, norm.weight, 1e-6)
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


ATTENTION = [
    # (id, rows, q heads, kv heads, head dim, cache positions, max_len): the edges
    ("gqa-one-split", 2, 8, 2, 16, 40, 40),
    ("gqa-splits", 3, 8, 2, 16, 300, 300),  # several splits, rows of 1 .. 300 keys
    ("mha", 2, 4, 4, 32, 70, 70),
    ("group-of-one-row", 1, 4, 1, 16, 130, 130),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ATTENTION, ids=[c[0] for c in ATTENTION])
def test_decode_attention_equals_softmax_attention(case, dtype, seed):
    _, rows, hq, hk, d, positions, max_len = case
    g = _gen(seed)
    q = torch.randn(rows, hq, d, generator=g).to(dtype)
    k_cache = torch.randn(rows + 1, hk, positions, d, generator=g).to(dtype)
    v_cache = torch.randn(rows + 1, hk, positions, d, generator=g).to(dtype)
    lengths = torch.randint(1, positions + 1, (rows,), generator=g)
    lengths[0] = positions  # a full row, and a one-key row where there is room
    if rows > 1:
        lengths[1] = 1
    scale = d**-0.5
    out = decode_attention(q, k_cache, v_cache, lengths, scale, max_len)
    group = hq // hk
    ref = torch.empty(rows, hq, d, dtype=torch.float64)
    for t in range(rows):
        n = int(lengths[t])
        for h in range(hq):
            keys = k_cache[t, h // group, :n].double()
            probs = torch.softmax(keys @ q[t, h].double() * scale, dim=0)
            ref[t, h] = probs @ v_cache[t, h // group, :n].double()
    assert_close(out, ref, dtype, what="attention")
    if case[0] == "gqa-splits":
        assert splits_for(rows, hk, max_len) > 1  # the case covers the combine kernel


PREFILLS = [
    # (id, q heads, kv heads, head dim, [(length, cache row, first position)]): the edges
    ("gqa-varlen", 8, 2, 16, [(5, 2, 0), (37, 0, 0), (1, 3, 0)]),  # one-token sequence too
    ("prefix-in-cache", 4, 4, 32, [(20, 1, 70), (9, 0, 3)]),  # chunks after a cached prefix
    ("one-long-group-of-one", 4, 1, 16, [(150, 0, 0)]),  # several key blocks, several q blocks
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PREFILLS, ids=[c[0] for c in PREFILLS])
def test_prefill_attention_equals_causal_softmax_attention(case, dtype, seed):
    """Each packed token against an fp64 softmax over its cache row's positions 0 .. its
    own; cache positions past every read position hold NaN (never read)."""
    _, hq, hk, d, seqs = case
    g = _gen(seed)
    lengths = [n for n, _, _ in seqs]
    rows = [r for _, r, _ in seqs]
    pos0 = [p for _, _, p in seqs]
    positions = max(p + n for n, _, p in seqs) + 3
    k_cache = torch.randn(4, hk, positions, d, generator=g).to(dtype)
    v_cache = torch.randn(4, hk, positions, d, generator=g).to(dtype)
    for n, r, p in seqs:  # nothing past a sequence's last position may be read
        k_cache[r, :, p + n :] = float("nan")
        v_cache[r, :, p + n :] = float("nan")
    q = torch.randn(sum(lengths), hq, d, generator=g).to(dtype)
    scale = d**-0.5
    table = varlen_table(lengths, rows, pos0, hq // hk, q.device)
    out = prefill_attention(q, k_cache, v_cache, table, scale)
    group = hq // hk
    ref = torch.empty(q.shape, dtype=torch.float64)
    t = 0
    for n, r, p in seqs:
        for i in range(n):
            for h in range(hq):
                keys = k_cache[r, h // group, : p + i + 1].double()
                probs = torch.softmax(keys @ q[t, h].double() * scale, dim=0)
                ref[t, h] = probs @ v_cache[r, h // group, : p + i + 1].double()
            t += 1
    assert not out.isnan().any()
    assert_close(out, ref, dtype, what="prefill attention")


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
    assert torch.equal(ids.long(), ref_ids), (ids, ref_ids)
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
