"""Outside truth for the decode engine (moelora/engine/engine.py), eager, on the CPU: every row of
a continuously batched run equals HF + PEFT generating that row alone with its adapter
(tokens equal; the logits each token was picked from within the fp32 tolerance of HF's
logits at that position), for every family of the toy models; requests joining at later
steps, cancels, stop ids, min / max_new_tokens, seeded sampling against HF's sampling, and
the checks that refuse a request before it runs."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import LogitsLog, greedy_alone, run_all, truth_logits
from hf_models import build_family, prompts

from moelora.compare import assert_close
from moelora.engine import Engine, Request, Sampling
from moelora.errors import ConfigError, InputError
from moelora.hf import attach, toy

pytestmark = pytest.mark.filterwarnings("ignore")
NEW = 4
# Every adapter, base rows between, an adapter twice (two rows share its slot).
ROWS = ["fused-r8", None, "fused-r4-attn", "modules-r4", "fused-r2", "fused-r8"]


@pytest.fixture(scope="module", params=list(toy.FAMILIES))
def family(request, tmp_path_factory):
    return build_family(request.param, tmp_path_factory.mktemp(request.param), seed=4321)


def _attached(family, num_slots=4):
    handle = attach(family.fresh(), num_slots=num_slots, max_rank=16, moe_backend="reference")
    for name, path in family.dirs.items():
        handle.load_adapter(path, name=name, **family.load_kwargs)
    return handle


def test_rows_equal_peft_alone_tokens_and_logits(family, seed, monkeypatch):
    """Rows of different prompt lengths and adapters, half joining one step later."""
    handle = _attached(family)
    engine = Engine(handle, max_rows=8, max_len=32, enforce_eager=True)
    log = LogitsLog(monkeypatch)
    rows = prompts(len(ROWS), handle.model.config.vocab_size, torch.Generator().manual_seed(seed))
    requests = [
        Request(f"r{i}", tuple(p.tolist()), name, Sampling(max_new_tokens=NEW))
        for i, (name, p) in enumerate(zip(ROWS, rows))
    ]
    got = run_all(engine, {0: requests[::2], 1: requests[1::2]})
    changed = 0
    for i, (name, prompt) in enumerate(zip(ROWS, rows)):
        truth = family.truth(name)
        tokens, reason = got[f"r{i}"]
        assert tokens == greedy_alone(truth, prompt, NEW), f"row {i} ({name})"
        assert reason == "length"
        out = torch.stack(log.by_request[f"r{i}"])
        ref = truth_logits(truth, prompt, tokens)
        assert_close(out, ref, torch.float32, what=f"row {i} ({name}) logits")
        if name is not None:
            changed += not torch.allclose(ref, truth_logits(family.base, prompt, tokens), atol=1e-3)
    assert changed == sum(n is not None for n in ROWS), "an adapter changed nothing"
    assert engine.running == 0 and not engine.has_work
    engine.close()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build_family("qwen3_moe", tmp_path_factory.mktemp("qwen"), seed=99)


def _prompt(seed: int, length: int, vocab: int = 96) -> tuple[int, ...]:
    return tuple(
        torch.randint(1, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    )


def test_joins_and_cancels(qwen, seed):
    """Requests join at steps 0, 2, 3 (one into the row a cancel freed) and equal their rows
    alone; the cancelled one ends with one 'cancelled' event and frees its row and slot."""
    handle = _attached(qwen, num_slots=3)
    engine = Engine(handle, max_rows=3, max_len=32, enforce_eager=True)
    p = [_prompt(seed + i, 3 + 2 * i) for i in range(5)]
    mk = lambda rid, i, name, n: Request(rid, p[i], name, Sampling(max_new_tokens=n))  # noqa: E731
    schedule = {
        0: [mk("a", 0, "fused-r8", 6), mk("gone", 1, "fused-r2", 9), mk("b", 2, None, 3)],
        3: [mk("c", 3, "modules-r4", 5)],  # rows full until the cancel at step 2 frees one
        4: [mk("d", 4, "fused-r4-attn", 4)],  # b finished at step 2: its row is free
    }
    got = run_all(engine, schedule, cancel={2: ["gone"]})
    assert got["gone"][1] == "cancelled" and len(got["gone"][0]) == 2  # steps 0, 1
    for rid, i, name, n in (("a", 0, "fused-r8", 6), ("b", 2, None, 3), ("c", 3, "modules-r4", 5),
                            ("d", 4, "fused-r4-attn", 4)):  # fmt: skip
        want = greedy_alone(qwen.truth(name), torch.tensor(p[i]), n)
        assert got[rid] == (want, "length"), rid
    engine.close()


SAMPLING_CASES = [
    # (id, sampling fields): each warper alone, then all together
    ("temperature", dict(temperature=0.7)),
    ("top_k", dict(temperature=1.0, top_k=5)),
    ("top_p", dict(temperature=1.3, top_p=0.8)),
    ("min_p", dict(temperature=1.2, min_p=0.1)),
    ("repetition_penalty", dict(temperature=0.8, repetition_penalty=1.5)),
    ("all", dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2)),
]


@pytest.mark.parametrize(
    "fields", [c[1] for c in SAMPLING_CASES], ids=[c[0] for c in SAMPLING_CASES]
)
def test_seeded_sampling_equals_hf(qwen, seed, fields):
    """A seeded request draws what HF draws for that row alone after torch.manual_seed(seed),
    beside a greedy row and an unseeded sampling row; a second run repeats it."""
    handle = _attached(qwen)
    engine = Engine(handle, max_rows=4, max_len=40, enforce_eager=True)
    prompt = _prompt(seed, 6)
    sampling = Sampling(max_new_tokens=8, seed=seed % 1000, **fields)
    runs = []
    for run in range(2):
        others = [Request(f"g{run}", _prompt(seed + 1, 4), None, Sampling(max_new_tokens=5)),
                  Request(f"u{run}", _prompt(seed + 2, 5), "fused-r8", Sampling(max_new_tokens=5, temperature=1.0))]  # fmt: skip
        got = run_all(engine, {0: [Request(f"s{run}", prompt, "fused-r2", sampling), *others]})
        runs.append(got[f"s{run}"][0])
    assert runs[0] == runs[1]
    torch.manual_seed(seed % 1000)
    hf_kwargs = dict(do_sample=True, temperature=fields["temperature"],
                     top_k=fields.get("top_k", 0), top_p=fields.get("top_p", 1.0),
                     min_p=fields.get("min_p"),
                     repetition_penalty=fields.get("repetition_penalty", 1.0))  # fmt: skip
    want = greedy_alone(qwen.truth("fused-r2"), torch.tensor(prompt), 8, **hf_kwargs)
    assert runs[0] == want
    engine.close()


GREEDY_CASES = [
    # (id, sampling fields, HF generate's): what decodes greedily
    ("tiny-temperature", dict(temperature=1e-300, seed=5), dict()),  # below 1e-5: greedy
    ("repetition-penalty", dict(repetition_penalty=1.8), dict(repetition_penalty=1.8)),
    ("penalty-below-1", dict(repetition_penalty=0.3), dict(repetition_penalty=0.3)),
]


@pytest.mark.parametrize("case", GREEDY_CASES, ids=[c[0] for c in GREEDY_CASES])
def test_greedy_rows_equal_hf(qwen, seed, case):
    """A temperature below vLLM's 1e-5 decodes greedily (it used to divide the logits into
    inf / NaN and end the step); the repetition penalty acts on greedy rows as HF's does
    (three prompts, 12 tokens each: a penalty must change at least one of them)."""
    _, fields, hf = case
    engine = Engine(_attached(qwen), max_rows=4, max_len=40, enforce_eager=True)
    prompts = [_prompt(seed + i, 6) for i in range(3)]
    requests = [Request(f"x{i}", p, "fused-r8", Sampling(max_new_tokens=12, **fields))
                for i, p in enumerate(prompts)]  # fmt: skip
    other = Request("y", _prompt(seed + 9, 4), None, Sampling(max_new_tokens=12))
    got = run_all(engine, {0: [*requests, other]})
    changed = 0
    for i, p in enumerate(prompts):
        want = greedy_alone(qwen.truth("fused-r8"), torch.tensor(p), 12, **hf)
        assert got[f"x{i}"] == (want, "length"), i
        changed += want != greedy_alone(qwen.truth("fused-r8"), torch.tensor(p), 12)
    assert changed >= 1 if hf else changed == 0
    engine.close()


def test_stop_ids_and_min_new_tokens(qwen, seed):
    """A stop id ends a request with reason 'stop' (the stop token is its last event), but not
    before min_new_tokens; as HF's eos_token_id / min_new_tokens do for the row alone."""
    handle = _attached(qwen)
    engine = Engine(handle, max_rows=2, max_len=40, enforce_eager=True)
    prompt = _prompt(seed, 5)
    free = greedy_alone(qwen.truth("fused-r8"), torch.tensor(prompt), 8)
    stop = free[2]  # greedy reaches it at the third token
    cases = [("stop", Sampling(max_new_tokens=8, stop_token_ids=(stop,))),
             ("late", Sampling(max_new_tokens=8, stop_token_ids=(stop,), min_new_tokens=free.index(stop) + 2))]  # fmt: skip
    for rid, sampling in cases:
        got = run_all(engine, {0: [Request(rid, prompt, "fused-r8", sampling)]})
        want = greedy_alone(
            qwen.truth("fused-r8"), torch.tensor(prompt), 8, eos_token_id=stop,
            min_new_tokens=sampling.min_new_tokens,
        )  # fmt: skip
        tokens, reason = got[rid]
        assert tokens == want, rid
        assert reason == ("stop" if tokens[-1] == stop else "length"), rid
    late = got["late"][0]
    assert stop not in late[: free.index(stop) + 2] and len(late) >= free.index(stop) + 2
    engine.close()


REFUSED = [
    # (id, request, the words the message must name)
    ("empty-prompt", Request("x", (), None), ["prompt_ids", "empty"]),
    (
        "too-long",
        Request("x", (1,) * 20, None, Sampling(max_new_tokens=13)),
        ["33", "max_len = 32"],
    ),
    ("bad-token", Request("x", (1, 500), None), ["500", "[0, 96)"]),
    ("bad-top-p", Request("x", (1,), None, Sampling(top_p=0.0)), ["top_p", "(0, 1]"]),
    ("seed-past-int64", Request("x", (1,), None, Sampling(seed=2**70)), ["seed", str(2**70)]),
    ("seed-below-int64", Request("x", (1,), None, Sampling(seed=-(2**63) - 1)), ["seed"]),
    ("nan-min-p", Request("x", (1,), None, Sampling(min_p=float("nan"))), ["min_p"]),
    ("zero-penalty", Request("x", (1,), None, Sampling(repetition_penalty=0.0)), ["repetition"]),
]


def test_an_adapter_not_loaded_is_refused_when_add_holds_it(qwen):
    """The adapter is checked once in the engine, where add() holds its version (an unload
    between check() and add() is caught there); a refused add changes nothing."""
    engine = Engine(_attached(qwen), max_rows=2, max_len=32, enforce_eager=True)
    request = Request("x", (1, 2), "nope")
    engine.check(request)  # its prompt, sampling and length: fine
    with pytest.raises(InputError) as err:
        engine.add(request)
    assert "'nope'" in str(err.value) and "fused-r8" in str(err.value)
    assert engine.running == 0 and not engine.has_work


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_check_refuses_requests_that_can_never_run(qwen, case):
    _, request, words = case
    engine = Engine(_attached(qwen), max_rows=2, max_len=32, enforce_eager=True)
    with pytest.raises(InputError) as err:
        engine.check(request)
    assert all(w in str(err.value) for w in words), str(err.value)
    with pytest.raises(InputError):
        engine.add(request)
    assert engine.running == 0 and not engine.has_work  # a refused add changes nothing


def test_admissible_reasons(qwen):
    """No free row; every slot held by running requests of other adapters; None otherwise."""
    handle = _attached(qwen, num_slots=2)
    engine = Engine(handle, max_rows=3, max_len=32, enforce_eager=True)
    req = lambda rid, name: Request(rid, (5, 6, 7), name, Sampling(max_new_tokens=3))  # noqa: E731
    engine.add(req("a", "fused-r8"))
    engine.add(req("b", "fused-r2"))
    assert "slot" in engine.admissible(req("c", "modules-r4"))
    assert engine.admissible(req("c", "fused-r8")) is None  # shares a's slot
    assert engine.admissible(req("c", None)) is None
    engine.add(req("c", None))
    assert "no free row" in engine.admissible(req("d", None))
    with pytest.raises(InputError, match="no free row"):
        engine.add(req("d", None))
    got = run_all(engine)
    assert sorted(got) == ["a", "b", "c"] and engine.admissible(req("d", "modules-r4")) is None
    engine.close()


def test_a_pinned_adapter_takes_its_slot_for_admissible(qwen):
    """A pinned adapter no row holds still fills its slot: with the other slot held by a
    running row, a third adapter must wait (its hold would wait for a slot), while the
    pinned one and the held one are admissible."""
    handle = _attached(qwen, num_slots=2)
    handle.load_adapter(qwen.dirs["fused-r2"], name="fused-r2", pin=True)
    engine = Engine(handle, max_rows=3, max_len=32, enforce_eager=True)
    req = lambda rid, name: Request(rid, (5, 6, 7), name, Sampling(max_new_tokens=2))  # noqa: E731
    assert engine.admissible(req("a", "fused-r8")) is None  # one slot not pinned: free
    engine.add(req("a", "fused-r8"))
    reason = engine.admissible(req("b", "modules-r4"))
    assert reason is not None and "pinned" in reason, reason
    assert engine.admissible(req("b", "fused-r2")) is None  # the pinned one is in its slot
    assert engine.admissible(req("b", "fused-r8")) is None  # shares a's slot
    got = run_all(engine)
    assert sorted(got) == ["a"] and engine.admissible(req("c", "modules-r4")) is None
    engine.close()


def test_same_length_prompts_prefill_in_one_forward(qwen, seed, monkeypatch):
    """Five requests of two prompt lengths added at once (attention LoRA, experts, base):
    two prefill forwards, and every row equals HF + PEFT alone."""
    handle = _attached(qwen)
    engine = Engine(handle, max_rows=8, max_len=32, enforce_eager=True)
    forwards = []
    real = engine._prefill_rows
    monkeypatch.setattr(
        engine, "_prefill_rows", lambda p, r, h: forwards.append(r) or real(p, r, h)
    )
    plan = [("fused-r4-attn", 7), (None, 7), ("fused-r8", 5), ("modules-r4", 7), (None, 5)]
    requests = [
        Request(f"r{i}", _prompt(seed + i, n), name, Sampling(max_new_tokens=NEW))
        for i, (name, n) in enumerate(plan)
    ]
    got = run_all(engine, {0: requests})
    assert sorted(len(rows) for rows in forwards) == [2, 3], forwards
    for i, (name, _) in enumerate(plan):
        prompt = torch.tensor(requests[i].prompt_ids)
        assert got[f"r{i}"] == (greedy_alone(qwen.truth(name), prompt, NEW), "length"), i
    engine.close()


def test_a_cache_too_large_is_refused_named(qwen, monkeypatch):
    """Out of device memory at the cache's allocation: ConfigError naming max_rows x max_len
    and the fix; the engine's hold on the banks is released."""
    from moelora.engine import kv_cache

    def no_memory(self, key_states, value_states):
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    handle = _attached(qwen)
    monkeypatch.setattr(kv_cache.RowLayer, "lazy_initialization", no_memory)
    with pytest.raises(ConfigError, match=r"max_rows x max_len.*'8 x 4096'.*smaller max_len"):
        Engine(handle, max_rows=8, max_len=4096, enforce_eager=True)
    assert not handle.registry.manager.leased()
