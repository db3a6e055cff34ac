"""Qwen3.5-MoE's linear-attention layers on the runner (moelora/engine/linear_attention.py),
on the CPU: the chunked prefill form equals the per-token update in fp64 (lengths across
chunks, from a state); on a paged engine, rows equal HF + PEFT generating each row alone
through everything that touches a row's state: prompts prefilled in chunks beside running
decodes, rows preempted and recomputed, a step that fails after some layers advanced the
states (the rows retried alone, recomputed from their first token), a row reusing a
finished row's state, and prefix caching: a prompt starting with a cached prefix starts
from the snapshot of the linear-attention states at its boundary (engine/state_snapshots.py)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import QWEN35, greedy_alone, run_all, run_paged, runner_engine

from moelora.compare import assert_close
from moelora.engine import Request, Sampling
from moelora.engine import linear_attention as la
from moelora.hf import toy

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.mark.parametrize("length", [1, 5, 64, 150])
def test_the_chunked_form_equals_the_per_token_update(length, seed):
    g = torch.Generator().manual_seed(seed)
    heads, dk, dv = 3, 8, 6
    q = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=g), dim=-1)
    v = torch.randn(length, heads, dv, generator=g)
    g_log = -torch.rand(length, heads, generator=g)  # decays exp(g) in (0.37, 1]
    beta = torch.rand(length, heads, generator=g)
    state = torch.randn(heads, dk, dv, generator=g)
    q, k, v, g_log, beta, state = (t.double() for t in (q, k, v, g_log, beta, state))
    out, final = la._chunked(q, k, v, g_log, beta, state)
    s, ref = state.clone(), torch.empty(length, heads, dv, dtype=torch.float64)
    for t in range(length):  # S <- S e^g; S <- S + k (beta (v - S^T k))^T; out = S^T q
        s = s * g_log[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        ref[t] = torch.einsum("hkv,hk->hv", s, q[t])
    assert_close(out, ref, torch.float32, what="outputs")
    assert_close(final, s, torch.float32, what="final state")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny Qwen3.5-MoE (linear, full, linear attention) and two PEFT adapters: "every"
    (every Linear incl. the linear-attention projections, the LM head, the experts) and
    "mixer" (the linear-attention projections only)."""
    root = tmp_path_factory.mktemp("qwen35")
    base = toy.build_model("qwen3_5_moe_text", seed=23, **QWEN35)
    linears = sorted({n.split(".")[-1] for n, m in base.named_modules()
                      if type(m) is torch.nn.Linear})  # fmt: skip
    kinds = {
        "every": dict(r=4, lora_alpha=8, target_modules=linears,
                      target_parameters=toy.expert_parameters(base)),
        "mixer": dict(r=2, lora_alpha=4, target_modules=list(la_names())),
    }  # fmt: skip
    truths, dirs = {None: base}, {}
    for i, (name, kw) in enumerate(kinds.items()):
        dirs[name] = root / name
        truths[name] = toy.write_peft_adapter(base, dirs[name], seed=60 + i, **kw)
    return base, truths, dirs


def la_names():
    return ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


_engine = runner_engine


def _requests(seed: int, lengths, names, new: int) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [Request(f"r{i}", tuple(torch.randint(1, 96, (n,), generator=g).tolist()), name,
                    Sampling(max_new_tokens=new))
            for i, (n, name) in enumerate(zip(lengths, names))]  # fmt: skip


def _check(made, got, requests, new: int) -> None:
    for r in requests:
        want = greedy_alone(made[1][r.adapter], torch.tensor(r.prompt_ids), new)
        assert got[r.request_id] == (want, "length"), r.request_id


def test_chunks_preemptions_and_reused_rows_keep_every_rows_state(made, seed):
    """A 5-token budget (prompts in chunks beside decodes), 11 blocks of 4 positions for
    rows needing 5 each (preemptions), 5 requests over 3 rows (a row's state reused)."""
    engine = _engine(made, max_rows=3, max_len=40, block_size=4, num_blocks=11,
                     max_num_batched_tokens=5)  # fmt: skip
    assert engine.pool.prefix_caching and engine.snapshots is not None and engine.mixed is None
    requests = _requests(seed, (7, 9, 6, 11, 8), ["every", None, "mixer", "every", None], 8)
    tokens, reasons = run_paged(engine, [(min(i, 3), r) for i, r in enumerate(requests)], {})
    assert engine.preemptions > 0
    _check(made, {k: (tokens[k], reasons[k]) for k in reasons}, requests, 8)
    engine.pool.check()
    assert engine.pool.used == 0
    engine.close()


@pytest.mark.parametrize("length", [12, 13])  # the prompt ends on a block boundary, or not
def test_the_same_prompt_again_starts_from_the_state_kept_at_its_boundary(made, seed, length):
    """The second run of a prompt takes its blocks up to the last boundary before its last
    token and the state snapshot there, computes the rest, and equals HF + PEFT alone."""
    engine = _engine(made, max_rows=2, max_len=40, block_size=4)
    (first,) = _requests(seed, (length,), ["every"], 3)
    again = Request("again", first.prompt_ids, "every", Sampling(max_new_tokens=3))
    got = run_all(engine, {0: [first]})
    assert engine.pool.stats.hits == 0 and engine.snapshots.saved == 1
    got |= run_all(engine, {0: [again]})
    _check(made, got, [first, again], 3)
    kept = (length - 1) // 4 * 4
    assert engine.pool.stats.hits == kept and engine.snapshots.restored == 1
    engine.pool.check()
    engine.close()


def test_a_conversation_goes_on_from_the_last_turns_state(made, seed):
    """Turn 2's prompt is turn 1's prompt, its answer and more: it starts from the state
    kept at turn 1's boundary; under another adapter, the same prompt hits nothing (the
    digests name the adapter); more prompts than snapshots give up the oldest, and a
    prompt whose state was given up is computed whole. Every row equals HF + PEFT alone."""
    engine = _engine(made, max_rows=2, max_len=48, block_size=4)
    (turn1,) = _requests(seed, (10,), ["mixer"], 3)
    got = run_all(engine, {0: [turn1]})
    answer = got["r0"][0]
    g = torch.Generator().manual_seed(seed + 1)
    more = tuple(torch.randint(1, 96, (6,), generator=g).tolist())
    turn2 = Request("turn2", turn1.prompt_ids + tuple(answer) + more, "mixer",
                    Sampling(max_new_tokens=2))  # fmt: skip
    other = Request("other", turn2.prompt_ids, "every", Sampling(max_new_tokens=2))
    got |= run_all(engine, {0: [turn2]})
    assert engine.pool.stats.hits == 8 and engine.snapshots.restored == 1  # turn 1's 8
    got |= run_all(engine, {0: [other]})
    assert engine.pool.stats.hits == 8 and engine.snapshots.restored == 1
    # two snapshots (max_rows): two new prompts give up turn 1's and turn 2's
    fresh = [Request(f"fresh{i}", r.prompt_ids, None, r.sampling)
             for i, r in enumerate(_requests(seed + 2, (9, 11), [None, None], 1))]  # fmt: skip
    got |= run_all(engine, {0: fresh})
    again = Request("again", turn2.prompt_ids, "mixer", Sampling(max_new_tokens=2))
    restored = engine.snapshots.restored
    got |= run_all(engine, {0: [again]})
    assert engine.snapshots.restored == restored  # nothing kept for it any more
    _check(made, got, [turn1], 3)
    _check(made, got, [turn2, other, again], 2)
    _check(made, got, fresh, 1)
    engine.pool.check()
    engine.close()


@pytest.mark.parametrize("when", ["decode", "chunks"])
def test_a_step_failing_after_states_advanced_retries_rows_from_their_first_token(
    made, seed, monkeypatch, when
):
    """The last layer's MoE raises once, in a step of several rows (every linear-attention
    layer before it has advanced their states): each row is retried alone, recomputed from
    its first token in forwards of at most max_num_batched_tokens tokens, and every row
    still equals HF + PEFT alone."""
    budget = 64 if when == "decode" else 5
    engine = _engine(made, max_rows=3, max_len=40, max_num_batched_tokens=budget)
    requests = _requests(seed, (6, 9, 5), ["every", "mixer", None], 6)
    real, calls = engine.runner._moe, {"n": 0, "failed": 0}
    forwards, prefill = [], engine._prefill_rows

    def counted(prompts, *args, **kwargs):
        forwards.append(sum(len(p) for p in prompts))
        return prefill(prompts, *args, **kwargs)

    monkeypatch.setattr(engine, "_prefill_rows", counted)

    def moe(layer, x, slots, rows):
        last = layer.index == len(engine.runner.layers) - 1
        if last and x.shape[0] > 1:
            calls["n"] += 1
            if calls["n"] == 4:  # a step some steps in, after the states moved
                calls["failed"] += 1
                raise RuntimeError("injected")
        return real(layer, x, slots, rows)

    monkeypatch.setattr(engine.runner, "_moe", moe)
    got = run_all(engine, {0: requests[:2], 1: requests[2:]})
    assert calls["failed"] == 1
    _check(made, got, requests, 6)
    assert forwards and max(forwards) <= budget, forwards
    engine.close()


def test_the_cache_keeps_blocks_for_attention_layers_and_a_state_per_row_for_linear_ones(made):
    from moelora.engine.paged_cache import bytes_per_block

    engine = _engine(made, max_rows=3, max_len=40, block_size=4, num_blocks=21)
    cache, model = engine.cache, engine.model
    assert [layer is None for layer in cache.layers] == [True, False, True]
    assert sorted(cache.states) == [0, 2]
    mixer = model.model.layers[0].linear_attn
    state = cache.states[0]
    # a state per row, the spare row's, and one kept per row (prefix caching)
    assert state.conv.shape == (7, mixer.conv_dim, mixer.conv_kernel_size - 1)
    assert state.recurrent.shape == (7, 4, 8, 8) and state.recurrent.dtype == torch.float32
    per_row = la.state_bytes(model, engine.dtype)
    assert cache.nbytes() == 21 * bytes_per_block(model, 4, engine.dtype) + 7 * per_row
    engine.close()


def test_decode_graphs_captured_mid_run_advance_each_state_once(made, seed, monkeypatch):
    """Decode graphs captured on first use (no warmup(); a stand-in that, like a CUDA
    capture, runs the step once when capturing and once per replay): rows joining later
    need new buckets, and each row still equals HF + PEFT alone (a capture's warm-up run on
    the rows themselves would advance their states twice)."""
    from moelora.engine import step_graphs

    captured = []

    def capture(step, pool):
        out = step()  # the capture's warm-up run; recording runs nothing
        captured.append(out.shape[0])
        return step_graphs.Graph(lambda: out.copy_(step()), out)

    monkeypatch.setattr(step_graphs, "capture", capture)
    engine = _engine(made, max_rows=4, max_len=40, enforce_eager=False)
    assert engine.graphs is not None and engine.mixed is None
    requests = _requests(seed, (6, 4, 7, 5), ["every", None, "mixer", "every"], 5)
    got = run_all(engine, {0: requests[:1], 2: requests[1:2], 4: requests[2:]})
    assert sorted(set(captured)) == [1, 2, 4], captured  # buckets first met mid-run
    _check(made, got, requests, 5)
    engine.close()
