"""--adapter-preemption through the real scheduler and engine (CPU, the decode runner's
paged cache): more adapters in flight than slots, rows of held adapters suspended for a
request that waited max_wait for a slot and resumed later; every request ends with the
tokens HF + PEFT give it alone, none refused, each reader sees Accepted and Admitted once
and its tokens in order; a suspended request that is cancelled ends as cancelled; without
preemption nothing is suspended."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from engine_helpers import greedy_alone, runner_engine, tiny_qwen_with_adapters

from moelora.engine import Request, Sampling, TokenEvent
from moelora.serve.admission import AdmissionPolicy
from moelora.serve.scheduler import Accepted, Admitted, Refused, Scheduler

pytestmark = pytest.mark.filterwarnings("ignore")

NEW = 10
FAST = AdmissionPolicy(max_wait=0.05, min_run=0.05, preempt=True)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return tiny_qwen_with_adapters(tmp_path_factory.mktemp("preempt"), 43, 80)


class Reader:
    """A request's sink: what the scheduler sent it, in order; done once it finished."""

    def __init__(self) -> None:
        self.items: list = []
        self.done = threading.Event()

    def __call__(self, item) -> None:
        self.items.append(item)
        if isinstance(item, Refused) or (isinstance(item, TokenEvent) and item.finished):
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [i.token_id for i in self.items if isinstance(i, TokenEvent) and i.token_id >= 0]


def _engine(made):
    engine = runner_engine(made, max_rows=6, max_len=48, block_size=4)
    engine.handle.load_adapter(made[2]["attn"], name="third")  # 3 adapters over 2 slots
    return engine


def _requests(seed: int) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    names = ["every", "attn", "third", "every", "attn", "third"]
    return [Request(f"r{i}", tuple(torch.randint(1, 96, (5 + i,), generator=g).tolist()), n,
                    Sampling(max_new_tokens=NEW)) for i, n in enumerate(names)]  # fmt: skip


def _truth(made, r: Request) -> list[int]:
    model = made[1]["attn" if r.adapter == "third" else r.adapter]
    return greedy_alone(model, torch.tensor(r.prompt_ids), NEW)


def _serve(engine, policy, requests, slow_s: float = 0.02, started=None) -> dict[str, Reader]:
    """Every request submitted at once to a scheduler over `engine`, each step slowed to
    slow_s (so that waits pass max_wait); the readers once all are done (bounded).
    started(scheduler): called before the requests are submitted."""
    real_step = engine.step

    def slow_step():
        time.sleep(slow_s)
        return real_step()

    engine.step = slow_step
    scheduler = Scheduler(engine, admission=policy, idle_wait_s=0.01).start()
    if started is not None:
        started(scheduler)
    readers = {r.request_id: Reader() for r in requests}
    try:
        for r in requests:
            scheduler.submit(r, readers[r.request_id])
        for reader in readers.values():
            assert reader.done.wait(120), "a request never finished"
    finally:
        scheduler.stop()
    return readers


def test_preempted_rows_resume_exact_and_every_request_finishes(made, seed):
    engine = _engine(made)
    requests = _requests(seed)
    readers = _serve(engine, FAST, requests)
    assert engine.suspensions > 0, "nothing was preempted: the test does not cover it"
    for r in requests:
        items = readers[r.request_id].items
        kinds = [type(i) for i in items if not isinstance(i, TokenEvent)]
        assert kinds == [Accepted, Admitted], (r.request_id, kinds)
        assert items[-1].finished and items[-1].finish_reason == "length"
        assert readers[r.request_id].tokens == _truth(made, r), r.request_id
    assert engine.suspended == frozenset() and engine.pool.used == 0
    engine.close()


def test_without_preemption_nothing_is_suspended(made, seed):
    engine = _engine(made)
    requests = _requests(seed)
    readers = _serve(engine, AdmissionPolicy(max_wait=0.05), requests)
    assert engine.suspensions == 0
    for r in requests:
        assert readers[r.request_id].tokens == _truth(made, r), r.request_id
    engine.close()


def test_a_suspended_request_that_is_cancelled_ends_as_cancelled(made, seed):
    """Cancel each request as soon as it is suspended: it ends with finish reason
    "cancelled" (after the tokens it streamed), its engine state is dropped, the others
    finish exact."""
    engine = _engine(made)
    requests = _requests(seed)
    cancelled: list[str] = []
    holder: dict = {}
    real_suspend = engine.suspend

    def suspend(request_id):
        real_suspend(request_id)
        cancelled.append(request_id)
        holder["scheduler"].cancel(request_id)

    engine.suspend = suspend
    readers = _serve(engine, FAST, requests, started=lambda s: holder.update(scheduler=s))
    assert cancelled, "nothing was preempted: the test does not cover it"
    for r in requests:
        last = readers[r.request_id].items[-1]
        if r.request_id in cancelled:
            assert isinstance(last, TokenEvent) and last.finish_reason == "cancelled"
            got = readers[r.request_id].tokens
            assert got == _truth(made, r)[: len(got)], r.request_id
        else:
            assert readers[r.request_id].tokens == _truth(made, r), r.request_id
    assert engine.suspended == frozenset()
    engine.close()


def test_the_flag_reaches_the_policy_and_is_refused_without_a_paged_cache():
    """`moelora serve --adapter-preemption` parses, gives the scheduler the preempting
    policy, and is refused at startup (naming the flag and the fix) on an engine that
    cannot suspend; without it the default policy runs."""
    from types import SimpleNamespace

    from moelora.cli import build_parser
    from moelora.errors import ConfigError
    from moelora.serve.launch import _admission

    paged, flat = SimpleNamespace(pool=object()), SimpleNamespace(pool=None)
    on, off = SimpleNamespace(adapter_preemption=True), SimpleNamespace(adapter_preemption=False)
    assert _admission(on, paged) == AdmissionPolicy(preempt=True)
    assert _admission(off, flat) == AdmissionPolicy()
    with pytest.raises(ConfigError, match=r"--adapter-preemption.*paged cache.*Fix: drop"):
        _admission(on, flat)
    parse = build_parser().parse_args
    assert parse(["serve", "m", "--adapter-preemption"]).adapter_preemption
    assert not parse(["serve", "m"]).adapter_preemption
