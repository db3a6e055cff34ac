"""The stall watchdog: a thread of its own that logs, once per stall episode, every thread's
Python stack when a request has been in flight longer than `--stall-dump-seconds`.

A request is in flight from its submission to its end: waiting (submitted, or queued for a
row or a slot), admitted (in the engine, no token yet) or running (tokens coming). A stall
episode begins at the first poll that finds a request older than the deadline, and ends at
the first poll where every request in flight is younger than half of it (so a queue whose
ages hover around the deadline under overload is one episode, not a report a second). The
episode's one report, logged at WARNING on the `moelora.serve` logger (stderr when nothing
configured logging), names the overdue requests (id, adapter, age, state, tokens), the
scheduler's rows and queue and the adapters in slots, then every thread's stack
(sys._current_frames()), the scheduler thread's (`moelora-scheduler`) first: where it
waits is what issue 37's hang at 48 layers needs. `moelora_stall_reports_total` counts the
reports.

The watchdog reads snapshots (Scheduler.snapshot(): copies without the scheduler's lock,
since the scheduler thread may be the one stuck), polls at a bounded interval and never
raises into the server: a fault of its own is logged and it polls on.
"""

from __future__ import annotations

import enum
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from .metrics import Metrics

log = logging.getLogger("moelora.serve")

DEFAULT_STALL_S = 300.0
# Polls a quarter of the deadline apart, within these bounds: a report at most a second late
# on a deadline of minutes, and a poll (a copy of the requests in flight) no more than 100
# times a second on the tiny deadlines of tests.
MIN_POLL_S, MAX_POLL_S = 0.01, 1.0
SCHEDULER_THREAD = "moelora-scheduler"  # scheduler.py's thread name: its stack goes first


class State(enum.Enum):
    WAITING = "waiting"  # submitted, or queued for a row or an adapter slot
    ADMITTED = "admitted"  # in the engine, no token yet
    RUNNING = "running"  # tokens coming


@dataclass(frozen=True)
class InFlight:
    """One request the scheduler holds; times are time.perf_counter() readings."""

    request_id: str
    adapter: str | None
    submitted: float
    state: State
    tokens: int = 0
    last_token: float | None = None


@dataclass(frozen=True)
class SchedulerSnapshot:
    """What the scheduler holds at one moment. slots: the slot manager's key -> slot of the
    adapters in slots (None: not readable)."""

    requests: tuple[InFlight, ...]
    rows_running: int
    queued: int
    slots: dict | None = None


def poll_interval(stall_s: float) -> float:
    return min(MAX_POLL_S, max(MIN_POLL_S, stall_s / 4))


class StallWatchdog:
    """Polls `snapshot` (Scheduler.snapshot) while `alive()` (the scheduler's thread runs);
    stall_s 0: off (start() starts nothing). See the module doc."""

    def __init__(
        self,
        snapshot: Callable[[], SchedulerSnapshot],
        stall_s: float = DEFAULT_STALL_S,
        metrics: Metrics | None = None,
        alive: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.snapshot, self.stall_s, self.metrics = snapshot, stall_s, metrics
        self.alive, self.clock = alive, clock
        self.poll_s = poll_interval(stall_s)
        self.stalled = False  # inside a stall episode (its report logged)
        self.reports = 0
        self._failing = False  # the last poll raised (logged once, not every poll)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="moelora-watchdog", daemon=True)

    def start(self) -> StallWatchdog:
        if self.stall_s > 0:
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def poll(self, now: float | None = None) -> str | None:
        """One look at the requests in flight: the report, when this poll begins an episode."""
        now = self.clock() if now is None else now
        snap = self.snapshot()
        overdue = [r for r in snap.requests if now - r.submitted > self.stall_s]
        if self.stalled:
            if all(now - r.submitted < self.stall_s / 2 for r in snap.requests):
                self.stalled = False
                log.warning("moelora serve: the stall is over (no request in flight past "
                            "%.3g s)", self.stall_s / 2)  # fmt: skip
            return None
        if not overdue:
            return None
        self.stalled = True
        report = stall_report(snap, overdue, now, self.stall_s) + "\n" + thread_stacks()
        log.warning("%s", report)
        if self.metrics is not None:
            self.metrics.stall_reported()
        self.reports += 1  # last: who sees the count sees the report logged and counted
        return report

    def _main(self) -> None:
        while not self._stop.wait(self.poll_s) and self.alive():
            try:
                self.poll()
                self._failing = False
            except Exception:  # a bug of the watchdog's: never the server's business
                if not self._failing:
                    log.exception("the stall watchdog's poll failed; it polls on")
                self._failing = True


def stall_report(
    snap: SchedulerSnapshot, overdue: list[InFlight], now: float, stall_s: float
) -> str:
    """The report's head: the overdue requests, oldest first, and the scheduler's state."""
    lines = [f"moelora serve: {len(overdue)} request(s) in flight longer than --stall-dump-"
             f"seconds {stall_s:g}; every thread's stack follows"]  # fmt: skip
    for r in sorted(overdue, key=lambda r: r.submitted):
        last = "" if r.last_token is None else f", last token {now - r.last_token:.1f} s ago"
        lines.append(f"  overdue: id={r.request_id} adapter={r.adapter} age={now - r.submitted:.1f} s "
                     f"state={r.state.value} tokens={r.tokens}{last}")  # fmt: skip
    slots = "unknown" if snap.slots is None else (
        ", ".join(f"{k}: slot {s}" for k, s in sorted(snap.slots.items(), key=lambda i: i[1]))
        or "none")  # fmt: skip
    lines.append(f"  scheduler: {snap.rows_running} rows running, {snap.queued} queued, "
                 f"{len(snap.requests)} in flight; adapters in slots: {slots}")  # fmt: skip
    return "\n".join(lines)


def thread_stacks() -> str:
    """Every thread's Python stack, named from threading.enumerate(), the scheduler first."""
    threads = {t.ident: t for t in threading.enumerate()}
    stacks = []
    for ident, frame in sys._current_frames().items():
        thread = threads.get(ident)
        name = thread.name if thread is not None else "(not a threading.Thread)"
        daemon = ", daemon" if thread is not None and thread.daemon else ""
        text = "".join(traceback.format_stack(frame)).rstrip("\n")
        stacks.append(
            (name != SCHEDULER_THREAD, name, f"thread {name} (id {ident}{daemon}):\n{text}")
        )
    return "\n".join(s[2] for s in sorted(stacks))
