"""The scheduler against a scripted engine double (the engine contract, no model): FIFO
admission held while admissible() says wait and never refused for it, check() refusals,
cancellation of queued and running requests, stop() finishing then cancelling rows, and
faults: a check, an add or a step that raises fails only its requests, and a dead thread
refuses everything and says so (`alive`)."""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import pytest

from moelora.engine import Request, Sampling, TokenEvent
from moelora.errors import InputError
from moelora.serve.admission import AdmissionPolicy
from moelora.serve.scheduler import (
    Accepted,
    Admitted,
    EngineDead,
    Refused,
    Scheduler,
    ShuttingDown,
)


class ScriptedHandle:
    """What the scheduler reads of moelora.hf's handle: slot keys (the names), the slots,
    and hold() (the prefetch thread's copy into a slot)."""

    def __init__(self, engine: ScriptedEngine) -> None:
        self.engine = engine
        self.registry = SimpleNamespace(manager=self)
        self.pinned = frozenset()

    @property
    def num_slots(self) -> int:
        return self.engine.slots

    @property
    def loaded(self) -> dict[str, int]:
        with self.engine.lock:
            return {a: i for i, a in enumerate(self.engine.resident)}

    def version(self, name: str | None):
        return None if name is None or name in self.engine.unloaded else SimpleNamespace(key=name)

    def hold(self, names: list) -> list:
        for name in names:
            self.engine.copy_in(name, ahead=True)
        return [SimpleNamespace(release=lambda: None) for _ in names]


class ScriptedEngine:
    """Token i of a request is hash(request_id, i) % 1000; `slots` distinct adapters at once,
    resident in LRU slots (an add or a hold of an adapter in none evicts the least recently
    used one no row holds: none being free is a scheduler bug, raised); `gate` (an Event)
    blocks step() so a test can hold rows running."""

    def __init__(self, rows: int, slots: int, max_len: int = 64) -> None:
        self.rows, self.slots, self.max_len = rows, slots, max_len
        self.max_rows = rows
        self.lock = threading.Lock()
        self.resident: list[str] = []  # LRU first
        self.copies = {"ahead": 0, "at_add": 0}
        self.handle = ScriptedHandle(self)
        self.running_rows: dict[str, list] = {}
        self.pending: list = []
        self.cancelled: set[str] = set()
        self.added: list[str] = []
        self.most_adapters = 0
        self.unloaded: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.step_tokens = 0  # the engine's count of the last step's tokens

    def check(self, r) -> None:
        if len(r.prompt_ids) + r.sampling.max_new_tokens > self.max_len:
            raise InputError("prompt + max_new_tokens", len(r.prompt_ids), f"<= {self.max_len}")

    def _live(self):
        return [*self.running_rows.values(), *self.pending]

    def admissible(self, r) -> str | None:
        if r.adapter in self.unloaded:  # as the engine's slot_key does for a name gone
            raise InputError("adapter", repr(r.adapter), "a loaded adapter")
        if len(self._live()) >= self.rows:
            return "no free row"
        held = {row[0].adapter for row in self._live()} | {r.adapter}
        return "no slot" if len(held - {None}) > self.slots else None

    def add(self, r) -> None:
        with self.lock:  # the prefetch thread's copy_in reads the rows
            self.added.append(r.request_id)
            self.pending.append([r, 0])
        if r.adapter is not None:
            self.copy_in(r.adapter, ahead=False)

    def copy_in(self, adapter: str, ahead: bool) -> None:
        with self.lock:
            if adapter in self.resident:
                self.resident.remove(adapter)
            else:
                held = {row[0].adapter for row in self._live()}
                if len(self.resident) >= self.slots:
                    idle = [a for a in self.resident if a not in held]
                    assert idle, f"no idle slot for {adapter}: {self.resident} all held"
                    self.resident.remove(idle[0])
                self.copies["ahead" if ahead else "at_add"] += 1
            self.resident.append(adapter)

    def cancel(self, rid: str) -> None:
        self.cancelled.add(rid)

    @property
    def has_work(self) -> bool:
        return bool(self._live() or self.cancelled)

    @property
    def running(self) -> int:
        return len(self.running_rows)

    def step(self) -> list:
        self.gate.wait(30)
        with self.lock:  # the prefetch thread's copy_in reads the rows
            return self._step()

    def _step(self) -> list:
        for row in self.pending:
            self.running_rows[row[0].request_id] = row
        self.pending = []
        adapters = {row[0].adapter for row in self.running_rows.values()} - {None}
        self.most_adapters = max(self.most_adapters, len(adapters))
        events = []
        self.step_tokens = len(set(self.running_rows) - self.cancelled)
        for rid in self.cancelled & set(self.running_rows):
            del self.running_rows[rid]
            events.append(TokenEvent(rid, -1, True, "cancelled"))
        self.cancelled.clear()
        for rid, row in list(self.running_rows.items()):
            row[1] += 1
            done = row[1] >= row[0].sampling.max_new_tokens
            if done:
                del self.running_rows[rid]
            events.append(TokenEvent(rid, token(rid, row[1]), done, "length" if done else None))
        return events


def token(rid: str, i: int) -> int:
    return hash((rid, i)) % 1000


class Collector:
    def __init__(self) -> None:
        self.items: dict[str, list] = {}
        self.done = threading.Event()
        self.expected = 0
        self._lock = threading.Lock()

    def sink(self, rid: str):
        def put(item):
            with self._lock:
                self.items.setdefault(rid, []).append(item)
                if isinstance(item, Refused) or getattr(item, "finished", False):
                    self.expected -= 1
                    if self.expected == 0:
                        self.done.set()

        return put


def request(rid: str, adapter: str | None, new: int) -> Request:
    return Request(rid, (1, 2, 3), adapter, Sampling(max_new_tokens=new))


CASES = [
    # (id, rows, slots, requests, adapters): the edge each covers
    ("more-adapters-than-slots", 8, 2, 24, 6),  # requests wait for a slot, never refused
    ("more-requests-than-rows", 3, 8, 20, 4),  # requests wait for a row
    ("one-row-one-slot", 1, 1, 6, 3),  # strictly one at a time
]


POLICIES = [("fifo", None), ("by-adapter", AdmissionPolicy(max_wait=0.2))]


@pytest.mark.parametrize("policy", [p for _, p in POLICIES], ids=[i for i, _ in POLICIES])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_request_runs_once_and_none_is_refused(case, policy, seed):
    """FIFO adds in arrival order; by adapter in its own order, each request once."""
    _, rows, slots, count, adapters = case
    rng = random.Random(seed)
    engine = ScriptedEngine(rows, slots)
    scheduler = Scheduler(engine, idle_wait_s=0.01, admission=policy).start()
    got = Collector()
    got.expected = count
    reqs = [request(f"r{i}", rng.choice([None, *range(adapters)]), rng.randrange(1, 6))
            for i in range(count)]  # fmt: skip
    for r in reqs:
        scheduler.submit(r, got.sink(r.request_id))
    assert got.done.wait(30)
    scheduler.stop()
    if policy is None:
        assert engine.added == [r.request_id for r in reqs]  # FIFO admission
    assert sorted(engine.added) == sorted(r.request_id for r in reqs)
    assert engine.most_adapters <= slots
    for r in reqs:
        items = got.items[r.request_id]
        assert isinstance(items[0], Accepted) and isinstance(items[1], Admitted)
        want = [token(r.request_id, i) for i in range(1, r.sampling.max_new_tokens + 1)]
        assert [e.token_id for e in items[2:]] == want
        assert items[-1].finished and items[-1].finish_reason == "length"


def test_a_request_that_can_never_run_is_refused_at_once():
    engine = ScriptedEngine(rows=2, slots=2, max_len=8)
    scheduler = Scheduler(engine, idle_wait_s=0.01).start()
    got = Collector()
    got.expected = 2
    scheduler.submit(request("long", None, 6), got.sink("long"))  # 3 + 6 > 8
    scheduler.submit(request("ok", None, 2), got.sink("ok"))
    assert got.done.wait(30)
    scheduler.stop()
    refused = got.items["long"]
    assert len(refused) == 1 and isinstance(refused[0], Refused) and "8" in str(refused[0].error)
    assert got.items["ok"][-1].finish_reason == "length"


def test_cancel_frees_a_running_row_and_drops_a_queued_request():
    engine = ScriptedEngine(rows=1, slots=1)
    engine.gate.clear()  # hold the first step: "run" stays running, "queued" waits
    scheduler = Scheduler(engine, idle_wait_s=0.01).start()
    got = Collector()
    got.expected = 2
    scheduler.submit(request("run", "a", 50), got.sink("run"))
    scheduler.submit(request("queued", "b", 50), got.sink("queued"))
    for _ in range(3000):  # bounded: until "run" is added and its step blocked on the gate
        if engine.added:
            break
        threading.Event().wait(0.01)
    assert engine.added == ["run"]
    scheduler.cancel("run")
    scheduler.cancel("queued")
    engine.gate.set()
    assert got.done.wait(30)
    scheduler.stop()
    assert got.items["run"][-1].finish_reason == "cancelled"
    assert len(got.items["run"]) < 50  # freed, not run to its length
    assert isinstance(got.items["queued"][-1], Refused) and "queued" not in engine.added


def test_stop_finishes_running_rows_within_grace_then_cancels():
    engine = ScriptedEngine(rows=4, slots=4, max_len=2 * 10**9)
    scheduler = Scheduler(engine, idle_wait_s=0.01).start()
    got = Collector()
    got.expected = 2
    scheduler.submit(request("short", None, 3), got.sink("short"))
    scheduler.submit(request("endless", None, 10**9), got.sink("endless"))
    threading.Timer(0.2, scheduler.stop, kwargs={"grace_s": 0.3}).start()
    assert got.done.wait(30)
    assert got.items["short"][-1].finish_reason == "length"
    ended = got.items["endless"][-1]  # cancelled at the deadline; its reader told why
    assert isinstance(ended, Refused) and isinstance(ended.error, ShuttingDown)
    late = Collector()
    late.expected = 1
    scheduler.submit(request("late", None, 1), late.sink("late"))
    assert isinstance(late.items["late"][0], Refused)


def test_a_queued_request_whose_adapter_was_unloaded_is_refused():
    engine = ScriptedEngine(rows=1, slots=1)
    engine.gate.clear()  # "first" holds the only row; "second" waits behind it
    scheduler = Scheduler(engine, idle_wait_s=0.01).start()
    got = Collector()
    got.expected = 3
    for rid, adapter in (("first", "a"), ("second", "b"), ("third", None)):
        scheduler.submit(request(rid, adapter, 2), got.sink(rid))
    for _ in range(3000):  # bounded: until "first" is added and its step blocked on the gate
        if engine.added:
            break
        threading.Event().wait(0.01)
    engine.unloaded.add("b")  # unloaded while "second" waits
    engine.gate.set()
    assert got.done.wait(30)
    scheduler.stop()
    refused = got.items["second"][-1]
    assert isinstance(refused, Refused) and "'b'" in str(refused.error)
    assert got.items["first"][-1].finish_reason == "length"
    assert got.items["third"][-1].finish_reason == "length"  # the queue went on behind it
    assert sorted(engine.added) == ["first", "third"]


class FaultyEngine(ScriptedEngine):
    """ScriptedEngine whose check / add / step raise for requests named in `faults`
    (request id -> where), and whose has_work raises once `die` is set (a scheduler bug)."""

    def __init__(self, faults: dict[str, str], **kw) -> None:
        super().__init__(**kw)
        self.faults, self.die = faults, False

    def check(self, r) -> None:
        if self.faults.get(r.request_id) == "check":
            raise OverflowError("Overflow when unpacking long long")  # not an InputError
        super().check(r)

    def add(self, r) -> None:
        if self.faults.get(r.request_id) == "add":
            raise OverflowError("Overflow when unpacking long long")
        super().add(r)

    def step(self) -> list:
        if any(self.faults.get(rid) == "step" for rid in self.running_rows):
            self.faults = {k: v for k, v in self.faults.items() if v != "step"}
            raise RuntimeError("injected step fault")
        return super().step()

    @property
    def has_work(self) -> bool:
        if self.die:
            raise RuntimeError("injected scheduler fault")
        return super().has_work


FAULTS = [
    # (id, where the fault is): the request it concerns fails, the others run, the thread lives
    ("check-raises", "check"),  # a check that raises something other than InputError
    ("add-raises", "add"),  # torch.Generator.manual_seed(2**70) raised here: the thread died
    ("step-raises", "step"),  # a step fault beyond the engine's own row isolation
]


@pytest.mark.parametrize("case", FAULTS, ids=[c[0] for c in FAULTS])
def test_a_fault_fails_only_its_requests_and_the_thread_serves_on(case):
    _, where = case
    engine = FaultyEngine({"bad": where}, rows=4, slots=4)
    scheduler = Scheduler(engine, idle_wait_s=0.01).start()
    got = Collector()
    got.expected = 2
    for rid in ("before", "bad"):
        scheduler.submit(request(rid, None, 3), got.sink(rid))
    assert got.done.wait(30)
    after = Collector()  # submitted once the fault has happened
    after.expected = 1
    scheduler.submit(request("after", "a", 2), after.sink("after"))
    assert after.done.wait(30)
    assert scheduler.alive
    scheduler.stop()
    failed = got.items["bad"][-1]
    assert isinstance(failed, Refused)
    assert "injected step fault" in str(failed.error) or "Overflow" in str(failed.error)
    assert after.items["after"][-1].finish_reason == "length"
    if where != "step":  # a step fault also ends the rows running beside it
        assert got.items["before"][-1].finish_reason == "length"


def test_a_dead_thread_refuses_everything_and_says_so():
    engine = FaultyEngine({}, rows=1, slots=1)
    engine.gate.clear()  # "running" holds the only row; "queued" waits behind it
    scheduler = Scheduler(engine, idle_wait_s=0.01).start()
    got = Collector()
    got.expected = 3
    scheduler.submit(request("running", None, 50), got.sink("running"))
    scheduler.submit(request("queued", None, 5), got.sink("queued"))
    for _ in range(3000):  # bounded: until "running" is added and its step blocked
        if engine.added:
            break
        threading.Event().wait(0.01)
    engine.die = True
    engine.gate.set()
    for _ in range(3000):  # bounded: until the thread has ended
        if not scheduler.alive:
            break
        threading.Event().wait(0.01)
    assert not scheduler.alive and "injected scheduler fault" in repr(scheduler.fault)
    scheduler.submit(request("late", None, 1), got.sink("late"))
    assert got.done.wait(30)
    for rid in ("running", "queued", "late"):
        item = got.items[rid][-1]
        assert isinstance(item, Refused) and isinstance(item.error, EngineDead), rid


def test_by_adapter_a_held_adapter_skips_a_blocked_head_and_a_cold_one_is_copied_ahead():
    """Rows of "a" and "b" hold both slots; "c" (needs a slot) queued before "a2": FIFO would
    hold "a2" behind it, by adapter "a2" joins a's rows at once. Every adapter ("c" once a
    slot frees) is copied by the prefetch thread before its requests join: none in add()."""
    engine = ScriptedEngine(rows=4, slots=2)
    engine.gate.clear()  # the first step blocks: "a1" and "b1" hold the slots meanwhile
    scheduler = Scheduler(engine, idle_wait_s=0.01, admission=AdmissionPolicy(max_wait=30))
    scheduler.start()
    got = Collector()
    got.expected = 4
    for rid, adapter in (("a1", "a"), ("b1", "b")):
        scheduler.submit(request(rid, adapter, 5), got.sink(rid))
    for _ in range(3000):  # bounded: until both are added and the step waits on the gate
        if len(engine.added) == 2:
            break
        threading.Event().wait(0.01)
    for rid, adapter in (("c1", "c"), ("a2", "a")):
        scheduler.submit(request(rid, adapter, 2), got.sink(rid))
    threading.Event().wait(0.2)  # the scheduler sees both while the step still blocks
    engine.gate.set()
    assert got.done.wait(30)
    scheduler.stop()
    assert engine.added.index("a2") < engine.added.index("c1")
    assert engine.copies == {"ahead": 3, "at_add": 0}  # every copy ahead, none in add()
    for rid in ("a1", "b1", "c1", "a2"):
        assert got.items[rid][-1].finish_reason == "length"
