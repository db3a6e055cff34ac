"""The stall watchdog (moelora/serve/watchdog.py): one report per stall episode, naming the
overdue requests and holding the stack of the thread that blocks, counted on /metrics; a
second report only once the stall has cleared and a new one begins. A polled case table
on a scripted snapshot and clock (no threads), then the real scheduler thread blocked in
the scripted engine's step() (tests/test_serve_scheduler.py's double)."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest
from test_serve_scheduler import Collector, ScriptedEngine, request

from moelora.serve.metrics import Metrics
from moelora.serve.scheduler import Scheduler
from moelora.serve.watchdog import (
    MAX_POLL_S,
    MIN_POLL_S,
    InFlight,
    SchedulerSnapshot,
    StallWatchdog,
    State,
    poll_interval,
)

STALL_S = 10.0


def _snap(*ages: float, now: float = 100.0) -> SchedulerSnapshot:
    """Requests r0, r1, ... submitted `ages` seconds before `now`."""
    reqs = tuple(InFlight(f"r{i}", "a", now - age, State.RUNNING, 3) for i, age in enumerate(ages))
    return SchedulerSnapshot(reqs, len(reqs), 0, {"a": 0})


EPISODES = [
    # (id, [(ages of the requests in flight at a poll, report expected), ...]): the edge
    ("young-never", [((1.0, 9.9), False), ((), False)]),  # nothing past the deadline
    ("one-per-episode", [((11.0,), True), ((12.0,), False), ((13.0, 11.0), False)]),
    # a new overdue request while still stalled: the same episode
    ("clears-then-again", [((11.0,), True), ((), False), ((11.0,), True)]),
    # between half the deadline and the deadline: not over yet, so no second report
    ("hysteresis", [((11.0,), True), ((6.0,), False), ((11.0,), False), ((4.0,), False),
                    ((12.0,), True)]),
]  # fmt: skip


@pytest.mark.parametrize("case", EPISODES, ids=[c[0] for c in EPISODES])
def test_one_report_per_episode(case):
    _, polls = case
    metrics = Metrics()
    current = {}
    dog = StallWatchdog(lambda: current["snap"], STALL_S, metrics)
    want = 0
    for ages, reported in polls:
        current["snap"] = _snap(*ages)
        out = dog.poll(now=100.0)
        assert (out is not None) == reported, (ages, out)
        want += reported
        if reported:
            oldest = max(range(len(ages)), key=lambda i: ages[i])
            assert f"id=r{oldest} adapter=a age={ages[oldest]:.1f} s state=running" in out
            assert "a: slot 0" in out and f"{len(ages)} rows running" in out
    assert dog.reports == metrics.stall_reports == want


def test_poll_interval_is_bounded():
    assert poll_interval(300.0) == MAX_POLL_S
    assert poll_interval(0.001) == MIN_POLL_S
    assert poll_interval(0.2) == pytest.approx(0.05)


def test_off_at_zero_starts_no_thread():
    dog = StallWatchdog(lambda: _snap(), 0.0).start()
    assert not dog._thread.is_alive()


def test_a_failing_snapshot_does_not_stop_the_watchdog(caplog):
    calls = []

    def snapshot():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("injected snapshot fault")
        return _snap(1.0, now=time.perf_counter())

    dog = StallWatchdog(snapshot, 0.04).start()  # polls every 10 ms
    for _ in range(300):  # bounded: until it has polled past the faults
        if len(calls) > 4:
            break
        time.sleep(0.01)
    dog.close()
    assert len(calls) > 4
    assert sum("injected snapshot fault" in r.exc_text for r in caplog.records if r.exc_text) == 1


def _until(predicate, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def _metrics_text(metrics: Metrics) -> str:
    """/metrics as the server renders it, over a handle with no adapters."""
    stats = SimpleNamespace(loads={}, load_seconds={}, evictions=0, registered=0, host_adapters=0)
    handle = SimpleNamespace(stats=lambda: stats, adapters=[], version=lambda name: None,
                             registry=SimpleNamespace(manager=SimpleNamespace(loaded={})))  # fmt: skip
    return metrics.render(handle)


def test_a_request_blocked_in_step_is_reported_once_per_episode(caplog):
    """The scheduler thread blocks in ScriptedEngine.step (its gate): one report names the
    request and holds that frame; polls go on without a second one; once the request ends
    the stall clears, and a new blocked request is a second report."""
    caplog.set_level(logging.WARNING, logger="moelora.serve")
    engine = ScriptedEngine(rows=2, slots=2)
    engine.gate.clear()
    metrics = Metrics()
    before = {t.ident for t in threading.enumerate()}
    scheduler = Scheduler(engine, metrics, idle_wait_s=0.01).start()
    # this scheduler's thread (other tests of the worker may leave idle ones of the name)
    (ours,) = [t.ident for t in threading.enumerate()
               if t.name == "moelora-scheduler" and t.ident not in before]  # fmt: skip
    dog = StallWatchdog(scheduler.snapshot, 0.2, metrics, lambda: scheduler.alive).start()
    try:
        got = Collector()
        got.expected = 1
        scheduler.submit(request("stuck-1", "a", 2), got.sink("stuck-1"))
        assert _until(lambda: dog.reports == 1)
        report = next(r.getMessage() for r in caplog.records if "overdue" in r.getMessage())
        assert "id=stuck-1 adapter=a" in report and "state=admitted tokens=0" in report
        assert "1 rows running, 0 queued" in report and "a: slot 0" in report
        # the blocked thread's stack: the scheduler thread, in the scripted step, on the gate
        scheduler_stack = report.split(f"thread moelora-scheduler (id {ours}")[1].split(
            "\nthread "
        )[0]
        assert "in step" in scheduler_stack and "self.gate.wait(30)" in scheduler_stack
        assert "in _step" in scheduler_stack  # Scheduler._step called it
        assert "moelora_stall_reports_total 1" in _metrics_text(metrics)
        time.sleep(10 * dog.poll_s)  # ten more polls of the same stall: no second report
        assert dog.reports == 1
        engine.gate.set()
        assert got.done.wait(10)
        assert _until(lambda: not dog.stalled)
        assert dog.reports == 1
        engine.gate.clear()  # a second episode
        again = Collector()
        again.expected = 1
        scheduler.submit(request("stuck-2", None, 2), again.sink("stuck-2"))
        assert _until(lambda: dog.reports == 2)
        reports = [r.getMessage() for r in caplog.records if "overdue" in r.getMessage()]
        assert len(reports) == 2 and "id=stuck-2 adapter=None" in reports[1]
        assert "stuck-1" not in reports[1]
        assert "moelora_stall_reports_total 2" in _metrics_text(metrics)
        engine.gate.set()
        assert again.done.wait(10)
    finally:
        engine.gate.set()
        scheduler.stop(0.0)
        dog.close()
