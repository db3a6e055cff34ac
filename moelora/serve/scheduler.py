"""The scheduler: one background thread drives Engine.step(); requests from any thread.

A request is submitted with a sink (a callable the scheduler thread calls with each item for
it: Accepted or Refused first, then Admitted when it joins the engine, then the engine's
TokenEvents). The thread checks it (Engine.check: a request that can never run is refused at
once) and queues it. Before each step it asks admission.py which waiting requests join
(adapter-aware: those that need no slot first, then whole groups of an adapter, copies of
adapters in no slot started ahead on the prefetch thread, and a bound on every request's
wait) and adds them while Engine.admissible() agrees; with `admission=None` it adds the
head of the queue first in first out instead. A request that must wait (no free row,
every adapter slot held by other adapters' rows) waits, it is never refused for it. Rows
join at the next step and leave when they finish (continuous batching). The engine is
touched by this thread only (and its handle's hold() by the prefetch thread).

No request can stop the thread: a check, an add or a step that raises fails only the
requests it concerns (the engine itself fails only the rows of a step that fail alone). If
the thread still dies (a bug), every request it holds is refused with EngineDead, later
submissions too, and `alive` is False (the server's /health answers 503).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .admission import AdmissionPolicy, Slots, Waiting, admit
from .metrics import Metrics, RowEnd
from .prefetch import Prefetcher
from .watchdog import InFlight, SchedulerSnapshot, State

log = logging.getLogger("moelora.serve")


@dataclass(frozen=True)
class Accepted:
    """The request passed Engine.check and is queued (it runs when a row and slot free)."""

    request_id: str


@dataclass(frozen=True)
class Admitted:
    """The request joined the engine: its tokens follow from the next step."""

    request_id: str


@dataclass(frozen=True)
class Refused:
    """The request never ran, or stopped without its tokens: `error` says why."""

    request_id: str
    error: Exception


class ShuttingDown(Exception):
    """The server is stopping: queued requests are refused, and rows still running at the
    end of the grace period are cancelled with this error."""


class EngineDead(Exception):
    """The scheduler thread has ended on an error: nothing runs any more."""


Sink = Callable[[object], None]


@dataclass
class _Ticket:
    request: object  # moelora.engine.Request
    sink: Sink
    submitted: float = field(default_factory=time.perf_counter)
    admitted: float | None = None  # joined the engine (vLLM's scheduled time)
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    progress: float | None = None  # its first token since it joined or resumed (Slots.started)
    suspended: float | None = None  # when the engine suspended it (it waits in the queue)


class Scheduler:
    """Drives `engine` (moelora.engine.Engine's API) from its own thread; see module doc."""

    def __init__(
        self,
        engine,
        metrics: Metrics | None = None,
        idle_wait_s: float = 0.05,
        admission: AdmissionPolicy | None = AdmissionPolicy(),  # noqa: B008 - frozen
    ) -> None:
        """admission: the adapter-aware policy (admission.py); None: first in first out.
        It reads the slots through engine.handle (moelora.hf's handle: num_slots,
        version(), hold(), registry.manager's loaded and pinned keys)."""
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.admission = admission
        self._keys: dict[str, object] = {}  # running request id -> the slot key it holds
        self.prefetcher = None if admission is None else Prefetcher(engine.handle, self._wake)
        self.idle_wait_s = idle_wait_s  # how long an idle thread sleeps between inbox checks
        self._cond = threading.Condition()
        self._inbox: list[_Ticket] = []  # submitted, not yet checked (under _cond)
        self._cancels: set[str] = set()  # request ids to stop (under _cond)
        self._waiting: collections.deque[_Ticket] = collections.deque()  # checked, FIFO
        self._running: dict[str, _Ticket] = {}
        self._accepting = True
        self._deadline: float | None = None  # set by begin_stop(): cancel what still runs then
        self.fault: BaseException | None = None  # why the thread ended, if it died
        self._thread = threading.Thread(target=self._main, name="moelora-scheduler", daemon=True)

    # ---- any thread -------------------------------------------------------------------------

    def start(self) -> Scheduler:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """The thread runs (False once it has ended: after stop(), or on a fault)."""
        return self._thread.is_alive()

    def submit(self, request, sink: Sink) -> None:
        """Queue `request`; `sink` gets Accepted or Refused, then Admitted and TokenEvents."""
        with self._cond:
            refusal = None
            if self.fault is not None:
                refusal = EngineDead(f"the engine stopped on an error: {self.fault!r}")
            elif not self._accepting:
                refusal = ShuttingDown("the server is shutting down")
            if refusal is None:
                self._inbox.append(_Ticket(request, sink))
                self._cond.notify()
                return
        _send(_Ticket(request, sink), Refused(request.request_id, refusal))

    def cancel(self, request_id: str) -> None:
        """Stop a request (its client left, or a stop string ended its text): its row is
        freed at the next step."""
        with self._cond:
            self._cancels.add(request_id)
            self._cond.notify()

    @property
    def queued(self) -> int:
        """Requests accepted or submitted that wait for a row or a slot."""
        return len(self._waiting) + len(self._inbox)

    @property
    def running(self) -> int:
        return len(self._running)

    def snapshot(self) -> SchedulerSnapshot:
        """The requests held now, for the stall watchdog (watchdog.py), read from any thread
        without the lock (the scheduler thread may be the one stuck): each container is
        copied by one C call the GIL keeps whole; a copy that meets a change is taken again.
        The slots are read from the slot manager's published map (no lock either)."""
        waiting, running = [], []
        for _ in range(3):
            try:
                waiting, running = [*self._inbox, *self._waiting], list(self._running.values())
                break
            except RuntimeError:  # changed while copied (possible only without the GIL)
                continue
        requests = [InFlight(t.request.request_id, t.request.adapter, t.submitted, State.WAITING)
                    for t in waiting]  # fmt: skip
        requests += [InFlight(t.request.request_id, t.request.adapter, t.submitted,
                              State.RUNNING if t.tokens else State.ADMITTED, t.tokens,
                              t.last_token) for t in running]  # fmt: skip
        try:
            slots = dict(self.engine.handle.registry.manager.loaded)
        except Exception:  # an engine without a slot manager: the report says unknown
            slots = None
        return SchedulerSnapshot(tuple(requests), len(running), len(waiting), slots)

    def begin_stop(self, grace_s: float = 30.0) -> None:
        """Stop accepting (queued requests are refused with ShuttingDown); running rows
        finish for up to `grace_s`, then are cancelled with ShuttingDown. Returns at once."""
        with self._cond:
            self._accepting = False
            deadline = time.monotonic() + grace_s
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
            self._cond.notify()

    def stop(self, grace_s: float = 30.0) -> None:
        """begin_stop(grace_s), then wait for the thread to end."""
        self.begin_stop(grace_s)
        if self._thread.is_alive():
            self._thread.join()

    # ---- the scheduler thread ------------------------------------------------------------------

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _main(self) -> None:
        try:
            self._loop()
        except BaseException as err:  # a bug: say so everywhere rather than hang requests
            log.exception("the scheduler thread died; every request it held is refused")
            with self._cond:
                self.fault = err
                tickets = [*self._inbox, *self._waiting, *self._running.values()]
                self._inbox, self._running, self._keys = [], {}, {}
                self._waiting.clear()
            dead = EngineDead(f"the engine stopped on an error: {err!r}")
            for ticket in tickets:
                _send(ticket, Refused(ticket.request.request_id, dead))
            self.metrics.set_load(queued=0, running=0)
        finally:
            if self.prefetcher is not None:
                self.prefetcher.close()

    def _loop(self) -> None:
        while True:
            inbox, cancels, stopping = self._take()
            self._check(inbox)
            self._cancel(cancels)
            if stopping:
                self._shutdown_step()
            self._admit()
            if self.engine.has_work:
                self._step()
            elif stopping and not self._waiting:
                return

    def _take(self) -> tuple[list[_Ticket], set[str], bool]:
        with self._cond:
            if not self._inbox and not self._cancels and not self.engine.has_work:
                if self._deadline is None:
                    self._cond.wait(self.idle_wait_s)
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
            return inbox, cancels, self._deadline is not None

    def _check(self, inbox: list[_Ticket]) -> None:
        for ticket in inbox:
            try:
                self.engine.check(ticket.request)
            except Exception as err:  # a refusal (InputError) or a fault of this request
                _send(ticket, Refused(ticket.request.request_id, err))
                continue
            _send(ticket, Accepted(ticket.request.request_id))
            self.metrics.accepted(ticket.request.adapter, len(ticket.request.prompt_ids))
            self._waiting.append(ticket)
        self._report_load()

    def _cancel(self, cancels: set[str]) -> None:
        for request_id in cancels:
            if request_id in self._running:
                self.engine.cancel(request_id)  # its cancelled event comes from step()
                continue
            for ticket in list(self._waiting):
                if ticket.request.request_id == request_id:
                    self._waiting.remove(ticket)
                    if ticket.suspended is not None:  # it has streamed: it ends as cancelled
                        from ..engine.engine import TokenEvent  # the engine's own finish

                        self.engine.drop_suspended(request_id)
                        _send(ticket, TokenEvent(request_id, -1, True, "cancelled"))
                        continue
                    _send(ticket, Refused(request_id, RuntimeError("cancelled")))

    def _shutdown_step(self) -> None:
        """While stopping: queued requests are refused; past the deadline, running rows are
        cancelled and their readers told why."""
        while self._waiting:
            ticket = self._waiting.popleft()
            if ticket.suspended is not None:  # suspended for a slot: it stops here
                self.engine.drop_suspended(ticket.request.request_id)
                error = ShuttingDown("the server shut down before the request finished")
                _send(ticket, Refused(ticket.request.request_id, error))
                continue
            error = ShuttingDown("the server is shutting down; the request did not start")
            _send(ticket, Refused(ticket.request.request_id, error))
        if self._running and time.monotonic() > self._deadline:
            error = ShuttingDown("the server shut down before the request finished")
            for request_id, ticket in self._running.items():
                self.engine.cancel(request_id)  # its cancelled event is dropped by _step
                _send(ticket, Refused(request_id, error))
            self._running.clear()
            self._keys.clear()

    def _admit(self) -> None:
        """Add what the admission policy plans (FIFO without one: the head while the engine
        says it runs at the next step), in the plan's order, stopping where the engine says
        wait. A request the engine refuses now (its adapter was unloaded while it waited)
        is refused."""
        if self.admission is None:
            while self._waiting and self._add(self._waiting[0]) is not False:
                pass
            self._report_load()
            return
        plan, keys = self._plan()
        if plan.preempt:  # the rows of these adapters leave their slots: plan again
            self._suspend(plan.preempt)
            plan, keys = self._plan()
        by_id = {t.request.request_id: t for t in self._waiting}
        for request_id in plan.admit:
            if self._add(by_id[request_id], keys[id(by_id[request_id])]) is False:
                break
        names = {keys[id(t)]: t.request.adapter for t in self._waiting}
        for key in plan.prefetch:
            self.prefetcher.start(key, names[key])
        self._report_load()

    def _plan(self):
        """The admission plan for the queue now, and each waiting ticket's slot key (by id).
        A suspended request waits from its suspension."""
        keys = {id(t): self._key(t.request.adapter) for t in self._waiting}
        queue = [Waiting(t.request.request_id, keys[id(t)], t.suspended or t.submitted)
                 for t in self._waiting]  # fmt: skip
        free_rows = max(0, self.engine.max_rows - len(self._running))
        return admit(queue, self._slots(), free_rows, time.perf_counter(), self.admission), keys

    def _suspend(self, adapters) -> None:
        """Suspend the running requests of `adapters` (slot keys) in the engine; they wait
        in the queue again, behind the requests there."""
        now = time.perf_counter()
        for request_id, key in list(self._keys.items()):
            if key not in adapters:
                continue
            ticket = self._running.pop(request_id)
            del self._keys[request_id]
            try:
                self.engine.suspend(request_id)
            except Exception as err:  # cannot be suspended: it ends, telling its reader
                log.warning("request %s could not be suspended: %r", request_id, err)
                self.engine.cancel(request_id)
                _send(ticket, Refused(request_id, err))
                continue
            ticket.suspended = now
            self._waiting.append(ticket)

    def _add(self, ticket: _Ticket, key: object = None) -> bool:
        """Add `ticket`'s request (resume it, if suspended) if the engine says it runs at
        the next step (False when it must wait); a refusal ends it. Either way but waiting
        it leaves the queue."""
        request_id = ticket.request.request_id
        try:
            if ticket.suspended is not None:
                if self.engine.resumable(request_id) is not None:
                    return False
                self.engine.resume(request_id)
            else:
                if self.engine.admissible(ticket.request) is not None:
                    return False
                self.engine.add(ticket.request)
        except Exception as err:
            self._waiting.remove(ticket)
            _send(ticket, Refused(request_id, err))
            return True
        self._waiting.remove(ticket)
        self._running[request_id] = ticket
        self._keys[request_id] = key
        ticket.progress = None
        if ticket.suspended is not None:  # resumed: its reader already has Admitted
            ticket.suspended = None
            return True
        ticket.admitted = time.perf_counter()
        self.metrics.admitted(ticket.admitted - ticket.submitted)
        _send(ticket, Admitted(request_id))
        return True

    def _key(self, name: str | None) -> object:
        """The slot key of adapter `name`'s current version (None: the base model, or a
        name not loaded, which needs no slot: the engine refuses it when it is added)."""
        version = None if name is None else self.engine.handle.version(name)
        return None if version is None else version.key

    def _slots(self) -> Slots:
        """The slots now: resident and pinned keys, the running rows' keys, the copies."""
        manager = self.engine.handle.registry.manager
        running = collections.Counter(k for k in self._keys.values() if k is not None)
        started, now = {}, time.perf_counter()
        for request_id, key in self._keys.items():  # admission.Slots.started
            since = self._running[request_id].progress or now  # no new token: not preemptible
            if key is not None and since > started.get(key, float("-inf")):
                started[key] = since
        return Slots(
            self.engine.handle.num_slots, frozenset(manager.loaded), running,
            frozenset(manager.pinned), self.prefetcher.loading, self.prefetcher.uncopyable,
            started,
        )  # fmt: skip

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as err:  # the engine fails rows itself; this is a fault beyond them
            log.exception("engine step failed; its running requests are ended")
            for request_id, ticket in self._running.items():
                self.engine.cancel(request_id)
                _send(ticket, Refused(request_id, err))
            self._running.clear()
            self._keys.clear()
            self._report_load()
            return
        now = time.perf_counter()
        if self.engine.step_tokens:
            self.metrics.stepped(self._iteration_tokens(events))
        for event in events:
            ticket = self._running.get(event.request_id)
            if ticket is None:  # cancelled at shutdown (its reader was told) or unknown
                continue
            if event.token_id >= 0:
                since = now - (ticket.last_token or ticket.submitted)
                self.metrics.token(since, ticket.last_token, ticket.request.adapter)
                ticket.first_token = ticket.first_token or now
                ticket.progress = ticket.progress or now
                ticket.last_token, ticket.tokens = now, ticket.tokens + 1
            if event.finished:
                del self._running[event.request_id]
                self._keys.pop(event.request_id, None)
                self._ended(ticket, now)
            _send(ticket, event)
        self._report_load()

    def _iteration_tokens(self, events) -> int:
        """A step's tokens as vLLM's iteration_tokens_total counts them: the tokens it
        sampled, and the whole prompt of each request whose first token it sampled (a
        chunk that does not end its prompt counts nothing; a resumed row's prompt is not
        counted again)."""
        total = 0
        for event in events:
            ticket = self._running.get(event.request_id)
            if ticket is not None and event.token_id >= 0:
                total += 1 + (len(ticket.request.prompt_ids) if ticket.tokens == 0 else 0)
        return total

    def _report_load(self) -> None:
        waiting = [t.request.adapter for t in [*self._waiting, *self._inbox]]
        running = [t.request.adapter for t in self._running.values()]
        self.metrics.set_load(self.queued, len(self._running), running, waiting)

    def _ended(self, ticket: _Ticket, now: float) -> None:
        """A row ended: its times and counts as vLLM's per-request histograms read them
        (a row that never got a token: prefill until its end, no decode)."""
        joined = ticket.admitted or ticket.submitted
        first, last = ticket.first_token or now, ticket.last_token or now
        decode = last - first
        self.metrics.ended(RowEnd(
            e2e_s=now - ticket.submitted, prefill_s=first - joined, decode_s=decode, inference_s=now - joined,
            per_token_s=decode / (ticket.tokens - 1) if ticket.tokens > 1 else 0.0,
            prompt_tokens=len(ticket.request.prompt_ids), generation_tokens=ticket.tokens,
            max_tokens=ticket.request.sampling.max_new_tokens,
        ))  # fmt: skip


def _send(ticket: _Ticket, item: object) -> None:
    try:
        ticket.sink(item)
    except Exception:  # a sink whose client has gone (its event loop closed): drop it
        log.debug("dropped an item for %s", ticket.request.request_id, exc_info=True)
