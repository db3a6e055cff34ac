"""No row can stop the decode engine: a prefill or decode forward that raises is run again
one row at a time, and only the rows that fail alone end (finish reason "error", with the
error); a row whose logits give no token (NaN) fails alone; every other row of those steps
equals HF + PEFT generating it alone, and the engine serves the next request. Faults are
injected around the engine's forward, keyed on one request's prompt token or adapter slot."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import greedy_alone, run_all
from hf_models import build_family

from moelora.engine import Engine, Request, Sampling
from moelora.engine.sampling import RowSampler, SamplingFault, next_tokens
from moelora.hf import attach

pytestmark = pytest.mark.filterwarnings("ignore")
NEW = 5
POISON = 7  # a prompt token the prefill fault keys on


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build_family("qwen3_moe", tmp_path_factory.mktemp("qwen"), seed=77)


def _engine(qwen) -> Engine:
    handle = attach(qwen.fresh(), num_slots=4, max_rank=16, moe_backend="reference")
    for name, path in qwen.dirs.items():
        handle.load_adapter(path, name=name, **qwen.load_kwargs)
    return Engine(handle, max_rows=4, max_len=32, enforce_eager=True)


def _prompt(seed: int, length: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(
        v if v != POISON else v + 1 for v in torch.randint(1, 96, (length,), generator=g).tolist()
    )


def _inject(monkeypatch, engine: Engine, fault) -> list[int]:
    """Wrap engine._forward: fault(ids, rows, logits) may raise or edit the logits; returns
    the list of batch sizes the wrapper saw (a retry shows as forwards of one row)."""
    real = engine._forward
    sizes: list[int] = []

    def forward(ids, positions, masks, rows):
        sizes.append(ids.shape[0])
        logits = real(ids, positions, masks, rows)
        fault(ids, rows, logits)
        return logits

    monkeypatch.setattr(engine, "_forward", forward)
    return sizes


def _check_others(qwen, got, requests, failed: str) -> None:
    for r in requests:
        if r.request_id == failed:
            continue
        want = greedy_alone(qwen.truth(r.adapter), torch.tensor(r.prompt_ids), NEW)
        assert got[r.request_id] == (want, "length"), r.request_id


def _events(engine: Engine, requests: list[Request]) -> dict:
    """request id -> (tokens, finish reason, error) of a run to the end."""
    for r in requests:
        engine.add(r)
    out = {r.request_id: ([], None, None) for r in requests}
    for _ in range(100):
        if not engine.has_work:
            break
        for e in engine.step():
            tokens, _, _ = out[e.request_id]
            if e.token_id >= 0:
                tokens.append(e.token_id)
            if e.finished:
                out[e.request_id] = (tokens, e.finish_reason, e.error)
    assert not engine.has_work
    return out


def test_a_prefill_that_raises_fails_only_its_row(qwen, seed, monkeypatch):
    engine = _engine(qwen)

    def fault(ids, rows, logits):
        if ids.shape[1] > 1 and bool((ids == POISON).any()):
            raise RuntimeError("injected prefill fault")

    sizes = _inject(monkeypatch, engine, fault)
    bad = list(_prompt(seed, 5))
    bad[2] = POISON
    requests = [Request("a", _prompt(seed + 1, 5), "fused-r8", Sampling(max_new_tokens=NEW)),
                Request("bad", tuple(bad), "fused-r2", Sampling(max_new_tokens=NEW)),
                Request("c", _prompt(seed + 2, 5), None, Sampling(max_new_tokens=NEW))]  # fmt: skip
    out = _events(engine, requests)
    tokens, reason, error = out["bad"]
    assert (tokens, reason) == ([], "error") and "injected prefill fault" in str(error)
    assert sizes[0] == 3 and sizes[1:4] == [1, 1, 1]  # one group, then one row at a time
    _check_others(qwen, {k: v[:2] for k, v in out.items()}, requests, "bad")
    engine.close()


def test_a_decode_that_raises_fails_only_its_row(qwen, seed, monkeypatch):
    engine = _engine(qwen)
    poison: list[int] = []

    def fault(ids, rows, logits):
        if ids.shape[1] == 1 and bool(torch.isin(rows.row_slots, torch.tensor(poison)).any()):
            raise RuntimeError("injected decode fault")

    _inject(monkeypatch, engine, fault)
    requests = [Request("a", _prompt(seed + 1, 4), "fused-r8", Sampling(max_new_tokens=NEW)),
                Request("bad", _prompt(seed, 6), "fused-r2", Sampling(max_new_tokens=NEW)),
                Request("c", _prompt(seed + 2, 3), "fused-r4-attn", Sampling(max_new_tokens=NEW))]  # fmt: skip
    for r in requests:
        engine.add(r)
    poison.append(engine._rows["bad"].hold.slot)
    got = run_all(engine)
    assert got["bad"] == ([got["bad"][0][0]], "error")  # its prefill token, then the fault
    _check_others(qwen, got, requests, "bad")
    # the engine serves on: the same adapter's next request runs once the fault is gone
    poison.clear()
    again = Request("again", _prompt(seed, 6), "fused-r2", Sampling(max_new_tokens=NEW))
    assert run_all(engine, {0: [again]})["again"] == (
        greedy_alone(qwen.truth("fused-r2"), torch.tensor(again.prompt_ids), NEW), "length")  # fmt: skip
    engine.close()


def test_nan_logits_fail_only_their_row(qwen, seed, monkeypatch):
    engine = _engine(qwen)
    poison: list[int] = []

    def fault(ids, rows, logits):
        hit = torch.isin(rows.row_slots[: logits.shape[0]], torch.tensor(poison))
        logits[hit] = float("nan")

    _inject(monkeypatch, engine, fault)
    requests = [Request("a", _prompt(seed + 1, 4), "fused-r8", Sampling(max_new_tokens=NEW)),
                Request("bad", _prompt(seed, 6), "modules-r4", Sampling(max_new_tokens=NEW, temperature=0.9)),
                Request("c", _prompt(seed + 2, 3), None, Sampling(max_new_tokens=NEW))]  # fmt: skip
    for r in requests:
        engine.add(r)
    poison.append(engine._rows["bad"].hold.slot)
    got = run_all(engine)
    assert got["bad"] == ([], "error")
    _check_others(qwen, got, requests, "bad")
    engine.close()


PICK_CASES = [
    # (id, the broken row's logits, its sampling): a row that gives no token
    ("nan-greedy", "nan", dict()),
    ("posinf-greedy", "posinf", dict()),
    ("nan-sampled", "nan", dict(temperature=0.8)),
    ("nan-seeded", "nan", dict(temperature=0.8, seed=3)),
    ("all-neginf-sampled", "neginf", dict(temperature=0.8)),
]


@pytest.mark.parametrize("case", PICK_CASES, ids=[c[0] for c in PICK_CASES])
def test_next_tokens_fails_only_the_broken_row(case, seed):
    """The other rows pick exactly what they pick without the broken row beside them."""
    _, kind, fields = case
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 50, generator=g)
    samplings = [Sampling(), Sampling(temperature=0.7, seed=11), Sampling(**fields),
                 Sampling(temperature=1.0, top_p=0.9, seed=12)]  # fmt: skip
    rows = [RowSampler.make(s, frozenset(), "cpu") for s in samplings]
    broken = logits.clone()
    broken[2] = {"nan": float("nan"), "posinf": float("inf"), "neginf": float("-inf")}[kind]
    if kind == "posinf":
        broken[2] = torch.randn(50, generator=g)
        broken[2, 5] = float("inf")
    out = next_tokens(broken, rows, [0] * 4)
    assert isinstance(out[2], SamplingFault)
    fresh = [RowSampler.make(s, frozenset(), "cpu") for s in samplings]
    alone = [next_tokens(logits[[i]], [fresh[i]], [0])[0] for i in (0, 1, 3)]
    assert [out[0], out[1], out[3]] == alone
