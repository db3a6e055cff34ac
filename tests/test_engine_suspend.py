"""Engine.suspend / resume (the serving scheduler's bound on a request's wait for a slot,
serve/admission.py): a running request leaves its row, blocks and adapter slot without
ending, another adapter takes the slot, and the request resumes with the tokens HF + PEFT
give it alone, also when suspended before its first token or mid-prompt; resumed rows hit
their own cached blocks; a request whose adapter was replaced or unloaded while it was
suspended is refused with why, and nothing else changes. CPU, kernels through Triton's
interpreter."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from engine_helpers import (
    LogitsLog,
    greedy_alone,
    runner_engine,
    tiny_qwen_with_adapters,
    truth_logits,
)

from moelora.engine import Request, Sampling
from moelora.errors import InputError

pytestmark = pytest.mark.filterwarnings("ignore")

NEW = 9


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return tiny_qwen_with_adapters(tmp_path_factory.mktemp("suspend"), 37, 70)


def _requests(seed, names, lengths=(7, 9, 6)) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [Request(f"r{i}", tuple(torch.randint(1, 96, (n,), generator=g).tolist()), name,
                    Sampling(max_new_tokens=NEW))
            for i, (n, name) in enumerate(zip(lengths, names))]  # fmt: skip


def _alone(made, request: Request) -> list[int]:
    return greedy_alone(made[1][request.adapter], torch.tensor(request.prompt_ids), NEW)


def _drive(engine, requests, actions: dict[int, list], limit: int = 200):
    """Add every request, then step; actions[k]: callables run before step k. Returns
    request id -> tokens (each finishing with "length")."""
    for r in requests:
        engine.add(r)
    tokens = defaultdict(list)
    for step in range(limit):
        for act in actions.get(step, []):
            act()
        if not engine.has_work and not engine.suspended:
            break
        for event in engine.step():
            assert event.error is None, event
            if event.token_id >= 0:
                tokens[event.request_id].append(event.token_id)
            if event.finished:
                assert event.finish_reason == "length"
        engine.pool.check()
        assert engine.pool.used == len({b for r in engine._rows.values() for b in r.blocks})
    assert not engine.has_work and not engine.suspended
    return tokens


@pytest.mark.parametrize("at", [0, 1, 4], ids=["before-its-prompt", "mid-prompt", "decoding"])
def test_a_suspended_request_resumes_with_its_own_tokens(made, seed, at, monkeypatch):
    """r0 ("every": LoRA on every module and the experts) suspended before step `at`,
    resumed two steps later, while r1 and r2 run on: every row equals HF + PEFT alone,
    tokens and the logits each token was picked from (a tiny random model repeats tokens,
    so tokens alone could agree with a row recomputed at the wrong positions)."""
    engine = runner_engine(
        made, max_rows=3, max_len=40, block_size=4, max_num_batched_tokens=5
    )  # fmt: skip (chunks: a prompt spans steps)
    log = LogitsLog(monkeypatch)
    requests = _requests(seed, ["every", "attn", None])
    got = _drive(engine, requests, {at: [lambda: engine.suspend("r0")],
                                    at + 2: [lambda: engine.resume("r0")]})  # fmt: skip
    assert engine.suspensions == 1
    for r in requests:
        assert got[r.request_id] == _alone(made, r), r.request_id
        want = truth_logits(made[1][r.adapter], torch.tensor(r.prompt_ids), got[r.request_id])
        torch.testing.assert_close(torch.stack(log.by_request[r.request_id]), want,
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
    assert engine.pool.used == 0
    engine.close()


def test_suspension_frees_the_slot_for_another_adapter(made, seed, tmp_path):
    """Two slots held by "every" and "attn" rows: a third adapter waits; once the "every"
    row is suspended it joins, and the suspended row waits for a slot in its turn, then
    resumes exactly (its adapter copied into a slot again)."""
    engine = runner_engine(made, max_rows=3, max_len=40, block_size=4)
    engine.handle.load_adapter(made[2]["attn"], name="third")  # a third version: a slot
    requests = _requests(seed, ["every", "attn"])
    third = _requests(seed + 1, ["third"])[0]
    third = Request("r9", third.prompt_ids, "third", third.sampling)
    waits = {}

    def suspend_and_add():
        waits["before"] = engine.admissible(third)
        engine.suspend("r0")
        waits["after"] = engine.admissible(third)
        engine.add(third)
        waits["resume"] = engine.resumable("r0")

    def resume_when_a_slot_frees():
        if "r0" in engine.suspended and engine.resumable("r0") is None:
            engine.resume("r0")
            waits["resumed"] = True

    later = {k: [resume_when_a_slot_frees] for k in range(4, 100)}
    got = _drive(engine, requests, {3: [suspend_and_add], **later})
    assert "slot" in waits["before"] and waits["after"] is None and "slot" in waits["resume"]
    assert waits["resumed"]
    for r in requests:
        assert got[r.request_id] == _alone(made, r), r.request_id
    assert got["r9"] == greedy_alone(made[1]["attn"], torch.tensor(third.prompt_ids), NEW)
    engine.close()


@pytest.mark.parametrize("change", ["replaced", "unloaded"])
def test_a_request_whose_adapter_changed_while_suspended_is_refused(made, seed, change):
    """Its tokens came from the version it held: resuming on another would mix two
    adapters in one output. resume() refuses it naming why, forgets it, and the other
    rows go on exact."""
    engine = runner_engine(made, max_rows=3, max_len=40, block_size=4)
    requests = _requests(seed, ["every", "attn"])
    refused = []

    def change_and_resume():
        if change == "replaced":
            engine.handle.load_adapter(made[2]["attn"], name="every")
        else:
            engine.handle.unload_adapter("every")
        with pytest.raises(InputError, match=f"'every'.*{change} while the request was suspended"):
            engine.resume("r0")
        refused.append(engine.suspended)

    got = _drive(engine, requests, {2: [lambda: engine.suspend("r0")], 4: [change_and_resume]})
    assert refused == [frozenset()]
    assert got["r1"] == _alone(made, requests[1])
    assert len(got["r0"]) < NEW
    engine.close()


def test_suspend_refuses_what_it_cannot_take(made, seed):
    engine = runner_engine(made, max_rows=1, max_len=40, block_size=4)
    (r0,) = _requests(seed, ["every"], lengths=(5,))
    with pytest.raises(InputError, match="'nope'"):
        engine.suspend("nope")
    engine.add(r0)
    engine.step()
    engine.suspend("r0")
    with pytest.raises(InputError, match="a running request's id"):
        engine.suspend("r0")  # already out
    other = Request("r1", (3, 4, 5), None, Sampling(max_new_tokens=2))
    engine.add(other)  # takes the one row
    assert "no free row" in engine.resumable("r0")
    with pytest.raises(InputError, match="no free row"):
        engine.resume("r0")
    assert engine.suspended == {"r0"}  # still waiting, nothing lost
    engine.drop_suspended("r0")
    assert engine.suspended == frozenset()
    engine.close()
    flat = runner_engine(made, max_rows=1, max_len=40, runner=False)
    flat.add(r0)
    with pytest.raises(InputError, match="paged cache"):
        flat.suspend("r0")
    flat.close()
