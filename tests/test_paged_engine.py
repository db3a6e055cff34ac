"""The engine's paged KV cache on the runner (CPU, kernels through Triton's interpreter):
rows that run out of blocks are preempted and recomputed and still give the tokens HF + PEFT
give each row alone; a prompt whose leading blocks another request of the same adapter
version computed reads them from the cache (fewer tokens prefilled, the row still exact),
never another adapter's or a replaced version's; random arrivals, lengths, adapters and
cancellations on a pool too small for them all end with every block returned."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from engine_helpers import (
    greedy_alone,
    run_all,
    run_paged,
    runner_engine,
    tiny_qwen_with_adapters,
)

from moelora.engine import Engine, Request, Sampling
from moelora.errors import ConfigError, InputError

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny Qwen3-MoE model and two PEFT adapters (one on every module, one on attention)."""
    return tiny_qwen_with_adapters(tmp_path_factory.mktemp("paged"), 33, 50)


_engine = runner_engine


def _prompts(seed: int, lengths) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(1, 96, (n,), generator=g).tolist()) for n in lengths]


def _alone(made, request: Request, n: int) -> list[int]:
    truth = made[1][request.adapter]
    return greedy_alone(truth, torch.tensor(request.prompt_ids), n)


def _prefilled(engine: Engine, monkeypatch) -> list[int]:
    """The token count of each runner prefill from now on."""
    sizes, real = [], engine.runner.prefill
    monkeypatch.setattr(engine.runner, "prefill",
                        lambda *a, **k: sizes.append(int(a[0].shape[0])) or real(*a, **k))  # fmt: skip
    return sizes


def test_rows_out_of_blocks_are_preempted_and_resume_with_their_own_tokens(made, seed):
    """10 blocks of 4 positions (one max_len row) for 4 rows that need 5 each: the newest
    rows are preempted, recomputed, and every row equals HF + PEFT alone."""
    engine = _engine(made, max_rows=4, max_len=40, block_size=4, num_blocks=11)
    names = ["every", None, "attn", "every"]
    requests = [Request(f"r{i}", p, name, Sampling(max_new_tokens=10))
                for i, (p, name) in enumerate(zip(_prompts(seed, (7, 9, 6, 8)), names))]  # fmt: skip
    got = run_all(engine, {0: requests[:2], 1: requests[2:]})
    assert engine.preemptions > 0
    for r in requests:
        assert got[r.request_id] == (_alone(made, r, 10), "length"), r.request_id
    engine.pool.check()
    assert engine.pool.used == 0 and engine.pool.available == engine.pool.capacity
    engine.close()


def test_a_cached_prefix_is_read_not_recomputed_and_only_for_its_adapter_version(
    made, seed, monkeypatch
):
    engine = _engine(made, max_rows=2, max_len=40, block_size=4)
    sizes = _prefilled(engine, monkeypatch)
    (prompt,) = _prompts(seed, (13,))
    longer = (*prompt, 5, 6, 7)
    first = Request("first", prompt, "every", Sampling(max_new_tokens=4))
    assert run_all(engine, {0: [first]})["first"][0] == _alone(made, first, 4)
    assert sizes == [13]
    # the same adapter, the prompt and more: 3 full blocks (12 tokens) read from the cache
    again = Request("again", longer, "every", Sampling(max_new_tokens=4))
    assert run_all(engine, {0: [again]})["again"][0] == _alone(made, again, 4)
    assert sizes[1:] == [16 - 12] and engine.pool.stats.hits == 12
    # another adapter, and the base model: nothing read
    for name in ("attn", None):
        other = Request(f"other-{name}", longer, name, Sampling(max_new_tokens=3))
        assert run_all(engine, {0: [other]})[other.request_id][0] == _alone(made, other, 3)
        assert sizes[-1] == 16
    # the adapter replaced by a new version of the same name: its old blocks are never read
    engine.handle.load_adapter(made[2]["attn"], name="every")
    replaced = Request("replaced", longer, "every", Sampling(max_new_tokens=3))
    want = greedy_alone(made[1]["attn"], torch.tensor(longer), 3)
    assert run_all(engine, {0: [replaced]})["replaced"][0] == want
    assert sizes[-1] == 16 and engine.pool.stats.hits == 12
    assert engine.pool.stats.queries == 13 + 4 * 16  # each prompt looked up once
    engine.close()


def test_a_prompt_read_whole_from_the_cache_still_computes_its_last_token(made, seed, monkeypatch):
    engine = _engine(made, max_rows=2, max_len=40, block_size=4)
    sizes = _prefilled(engine, monkeypatch)
    (prompt,) = _prompts(seed, (12,))  # three full blocks
    requests = [Request(f"r{i}", prompt, None, Sampling(max_new_tokens=3)) for i in range(2)]
    got = run_all(engine, {0: requests[:1], 4: requests[1:]})
    assert sizes == [12, 4]  # two blocks read; the third holds the last token: recomputed
    want = _alone(made, requests[0], 3)
    assert got["r0"][0] == got["r1"][0] == want
    engine.close()


def test_random_arrivals_lengths_and_cancels_return_every_block(made, seed):
    """A pool of 8 blocks of 4 for up to 4 rows of up to 32 positions: random arrivals,
    prompt lengths, output lengths, adapters and cancellations, each request added once
    admissible() agrees (as the server's scheduler does). Every row that runs to its end
    equals HF + PEFT alone; preemptions happen; the books agree after every step and every
    block comes back."""
    rng = random.Random(seed)
    engine = _engine(made, max_rows=4, max_len=32, block_size=4, num_blocks=9,
                     max_num_batched_tokens=8)  # fmt: skip
    shared = _prompts(seed, (9,))[0]  # some prompts share a prefix: cache hits happen too
    arrivals = []
    for i in range(8):
        own = _prompts(seed + i + 1, (rng.randint(2, 12),))[0]
        if i < 3:  # the same adapter and 9 leading tokens, arriving together: shared blocks;
            # 26 positions each (7 blocks, 2 shared) on a pool of 8: preemptions
            prompt = shared + own[: rng.randint(1, 3)]
            request = Request(f"q{i}", prompt, "every", Sampling(max_new_tokens=14))
            arrivals.append((i, request))
            continue
        request = Request(f"q{i}", own, rng.choice(["every", "attn", None]),
                          Sampling(max_new_tokens=rng.randint(1, 10)))  # fmt: skip
        arrivals.append((rng.randint(0, 8), request))
    cancels = {r.request_id: rng.randint(1, 12) for _, r in rng.sample(arrivals[3:], 2)}
    arrivals.sort(key=lambda a: a[0])
    tokens, reasons = run_paged(engine, arrivals, cancels)
    for _, r in arrivals:
        reason, got = reasons[r.request_id], tokens.get(r.request_id, [])
        if reason == "cancelled":
            continue
        assert reason in ("length", "stop"), (r.request_id, reason)
        assert got == _alone(made, r, len(got)), r.request_id
        assert reason == "stop" or len(got) == r.sampling.max_new_tokens
    assert engine.preemptions > 0 and engine.pool.stats.hits > 0
    assert engine.pool.used == 0 and engine.pool.available == engine.pool.capacity
    engine.close()


def test_too_few_blocks_for_one_request_is_refused_at_startup(made):
    with pytest.raises(ConfigError, match="num_blocks") as err:
        _engine(made, max_rows=2, max_len=40, block_size=4, num_blocks=10)
    assert "11" in str(err.value) and "max_len" in str(err.value)


def test_warm_prompts_leaves_the_engine_as_it_was_and_rows_exact(made, seed, monkeypatch):
    """warm_prompts (a server's start on a GPU: every prompt step's kernels compiled before
    the first request) runs its prompts through real prompt steps, chunked past the step
    budget and beside a decoding row, for the base model and an adapter; afterwards nothing
    runs, every block is free or cached, the counters a server exports are as before, and a
    request's tokens equal HF + PEFT alone."""
    engine = _engine(made, max_rows=4, max_len=48, block_size=4, max_num_batched_tokens=12)
    sizes = _prefilled(engine, monkeypatch)
    stats = dataclasses.replace(engine.pool.stats)
    warmed = engine.warm_prompts([None, "every"])
    # lengths capped by the step budget (12): 1, 5, 12; each once per adapter
    assert warmed.lengths == (1, 5, 12) and warmed.prompts == 6
    assert 12 in sizes and max(sizes) == 12  # the budget holds
    assert any(n not in (1, 5, 12) for n in sizes)  # a step with a decoding row beside a prompt
    assert not engine.has_work and engine.pool.used == 0
    engine.pool.check()
    assert engine.pool.stats == stats and engine.preemptions == 0 and engine.step_tokens == 0
    request = Request("after", _prompts(seed, (9,))[0], "every", Sampling(max_new_tokens=6))
    got = run_all(engine, {0: [request]})
    assert got["after"] == (_alone(made, request, 6), "length")


@pytest.mark.parametrize("fail", ["a step raises", "an adapter not loaded"])
def test_a_warm_up_that_fails_leaves_the_engine_as_it_was(made, seed, monkeypatch, fail):
    """A warm-up that fails (a step raising with warm-up rows prefilling and decoding, or an
    adapter name that is not loaded, after the base model's prompts ran) raises, and leaves
    no warm-up row, block or count behind."""
    engine = _engine(made, max_rows=4, max_len=48, block_size=4, max_num_batched_tokens=12)
    stats = dataclasses.replace(engine.pool.stats)
    if fail == "a step raises":
        calls, real = [0], engine.step

        def step():
            calls[0] += 1
            if calls[0] == 3:  # the 5-token prompt prefilling beside the 1-token one decoding
                assert engine.pool.used > 0 and len(engine._rows) == 2
                raise RuntimeError("a failing step")
            return real()

        monkeypatch.setattr(engine, "step", step)
    with pytest.raises((RuntimeError, InputError), match=r"failing step|nope"):
        engine.warm_prompts([None, "nope"])
    monkeypatch.undo()
    assert not engine.has_work and engine.pool.used == 0 and not engine._prefilling
    engine.pool.check()
    assert engine.pool.stats == stats and engine.step_tokens == 0
    request = Request("after", _prompts(seed, (7,))[0], None, Sampling(max_new_tokens=4))
    assert run_all(engine, {0: [request]})["after"] == (_alone(made, request, 4), "length")


def test_warm_prompts_on_an_engine_of_one_row(made):
    """max_rows 1 (--max-num-seqs 1): each warm-up prompt waits for the one before to end."""
    engine = _engine(made, max_rows=1, max_len=32, block_size=4, max_num_batched_tokens=8)
    warmed = engine.warm_prompts([None, "every"])
    assert warmed.prompts == 6 and not engine.has_work and engine.pool.used == 0


def test_warm_prompts_refuses_while_requests_run(made, seed):
    engine = _engine(made, max_rows=2, max_len=32, block_size=4)
    engine.add(Request("r", _prompts(seed, (5,))[0], None, Sampling(max_new_tokens=4)))
    with pytest.raises(InputError, match="no request running"):
        engine.warm_prompts()


def test_long_prefill_token_threshold_caps_each_prompts_chunk(made, seed, monkeypatch):
    """long_prefill_token_threshold 8 (vLLM's): a 30-token prompt arriving beside a decoding
    row is prefilled 8 tokens a step (each step 1 decode + 8, then 1 + 6), two 20-token
    prompts arriving together beside two decoding rows take 8 each in the same step (2 + 16,
    twice, then 2 + 4 + 4); every row equals HF + PEFT alone. Without it each prompt goes in
    whole (1 + 30, then 1 + 20 + 20): the tokens of each step that carries a prompt."""
    p = _prompts(seed, (5, 30, 20, 20))
    names = [None, "every", "attn", None]
    for threshold, want in ((8, [5, 9, 9, 9, 7, 18, 18, 10]), (0, [5, 31, 41])):
        engine = _engine(made, max_rows=4, max_len=48, block_size=4,
                         long_prefill_token_threshold=threshold)  # fmt: skip
        sizes = _prefilled(engine, monkeypatch)
        requests = [Request(f"r{i}", q, n, Sampling(max_new_tokens=n_new))
                    for i, (q, n, n_new) in enumerate(zip(p, names, (12, 4, 4, 4)))]  # fmt: skip
        got = run_all(engine, {0: requests[:1], 2: requests[1:2], 6: requests[2:]})
        assert sizes == want, threshold
        for r, n_new in zip(requests, (12, 4, 4, 4)):
            assert got[r.request_id] == (_alone(made, r, n_new), "length"), (threshold, r)


def test_a_negative_long_prefill_token_threshold_is_refused(made):
    with pytest.raises(ConfigError, match="long_prefill_token_threshold"):
        _engine(made, max_rows=2, max_len=32, long_prefill_token_threshold=-1)


def test_the_server_warms_the_base_model_and_one_adapter_of_each_kind(made):
    """moelora serve's warm-up list: the base model, then the first loaded adapter of each
    kind (expert LoRA or not, the modules with LoRA), at most three: a second adapter of the
    same kind adds nothing."""
    from moelora.serve.launch import warm_adapters

    engine = _engine(made, max_rows=2, max_len=32, block_size=4)
    engine.handle.load_adapter(made[2]["every"], name="every2")  # the kind of "every"
    assert warm_adapters(engine.handle) == [None, "attn", "every"]
    assert warm_adapters(engine.handle, most=1) == [None, "attn"]


def test_the_servers_warm_up_prints_what_it_ran_and_survives_a_failure(made, capsys,
                                                                         monkeypatch):  # fmt: skip
    """moelora serve's warm-up step (on a GPU; run here on the CPU runner): a line before,
    the warm-up's line after; a warm-up that raises is printed and the engine serves on."""
    import argparse

    from moelora.serve.launch import _warm_prompts

    engine = _engine(made, max_rows=2, max_len=32, block_size=4, max_num_batched_tokens=8)
    args = argparse.Namespace(command="serve")
    _warm_prompts(args, engine, engine.handle)
    out = capsys.readouterr().out
    assert (
        "compiling prompt steps (synthetic prompts up to 8 tokens for the base model and 2" in out
        and "prompt steps warmed: 9 prompts of 1 to 8 tokens" in out
    ), out

    def failing_step():
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "step", failing_step)
    _warm_prompts(args, engine, engine.handle)
    assert "prompt warm-up failed (RuntimeError: boom); serving without it" in (
        capsys.readouterr().out
    )
    assert not engine.has_work and engine.pool.used == 0
