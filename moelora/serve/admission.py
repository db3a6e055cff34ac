"""Adapter-aware admission: which waiting requests join the engine at the next step and
which adapters are copied into a slot ahead of their requests, as one pure function over
plain data (no engine, no model), so that its guarantees are property-tested
(tests/test_serve_admission.py). The scheduler thread (scheduler.py) feeds it the queue and
the slots, adds what it admits and hands the copies to its prefetch thread.

A slot can take a new adapter when no running row holds its adapter (the slot manager
evicts the least recently used idle one), so an adapter in no slot can join while fewer
than L adapters are held ("taken": held by running rows, pinned, being copied, or admitted
in this plan). The rule, in order:

1. Aged first. A request that has waited `max_wait` or longer goes before every other,
   oldest first. When the oldest of them waits for a row, nothing else is admitted until
   it has one (its adapter, in no slot, is copied ahead meanwhile where a slot can be
   taken). When it waits for a slot (every slot taken), held adapters are drained for
   it and for the aged requests behind it that need a slot too (one each, the least
   wanted first, at most half the slots): their new requests do not join, so their slots
   free once their rows end, and each freed slot goes to the oldest aged request; the
   requests that take no new slot (the base model, a held adapter not drained) keep
   joining meanwhile, so the rows stay busy while the slots turn over.
2. Free next, in arrival order: requests that take no slot (the base model, an adapter
   running rows hold), so a group joins the rows of its adapter.
3. Slots last: the adapters that need one, each group scored by its queue length, an
   adapter already in an idle slot (no copy) counted `swap_ratio` times, the highest first
   (resident first, then the oldest, among equal ones), while a slot can be taken without
   evicting an idle adapter whose waiting group ranks above it. A resident group joins at once.
   An adapter in no slot, with `Copy.AHEAD`, is copied by the prefetch thread and its
   requests join once it is in (the copy runs beside the steps); with `Copy.AT_ADMISSION`
   they join now and the engine's add() copies it.
   With `preempt` (off by default) a wait for a slot is bounded too: when the oldest aged
   request needs one and every slot is held, the held adapter with the fewest running
   rows (then the fewest waiting requests) whose newest row has run `min_run` is
   preempted: its rows are suspended (Engine.suspend: out of their rows and slot, resumed
   later by recompute with the tokens they would have given) and rejoin the queue,
   waiting anew, and the freed slot goes to the aged request. Rows hold their adapter's
   slot for their whole output, so with more adapters in flight than slots a wait is
   otherwise bounded only by the rows ahead of it (benchmarks/admission_sim.py: 8 slots
   for 32 names at concurrency 64 give a TTFT p99 near 20 s without it, under 4 s with
   it); the price is a pause in the preempted streams.
4. Draining, for a queue worth a swap: when an adapter in no slot waits and every slot is
   taken, the held adapter with the fewest waiting requests (then the fewest running rows)
   is drained if the waiting adapter's queue is more than `swap_ratio` times its own: its
   new requests do not join (they age as any other), so its slot frees once its rows end,
   and the waiting adapter's score then beats its own.

Times are in the caller's unit (seconds in the server, steps in the tests).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

Adapter = Hashable  # a slot key: one loaded version of an adapter (None: the base model)


class Copy(enum.Enum):
    """When an adapter in no slot is copied into one."""

    AHEAD = "ahead"  # by the prefetch thread; its requests join once it is in
    AT_ADMISSION = "at_admission"  # by the engine's add() of its first request


@dataclass(frozen=True)
class Waiting:
    """A queued request: its id, its adapter's slot key (None: the base model), arrival."""

    request_id: str
    adapter: Adapter | None
    arrived: float


@dataclass(frozen=True)
class Slots:
    """The adapter slots as the scheduler sees them before a plan. running: adapter ->
    running rows holding it (their slots cannot be written); pinned: never evicted;
    loading: being copied ahead (each takes a slot); uncopyable: adapters whose copy ahead
    failed (their requests join and the engine's add() copies, or refuses, them); started:
    adapter -> when the newest of its running rows gave its first token since it joined or
    resumed (AdmissionPolicy.preempt's min_run counts from there, so that every preempted
    row has made progress: a row suspended before a new token would loop forever)."""

    num_slots: int
    resident: frozenset = frozenset()
    running: Mapping = field(default_factory=dict)
    pinned: frozenset = frozenset()
    loading: frozenset = frozenset()
    uncopyable: frozenset = frozenset()
    started: Mapping = field(default_factory=dict)


@dataclass(frozen=True)
class AdmissionPolicy:
    """max_wait: a request waiting this long goes first (see the module doc); 3 s, chosen,
    not measured: under issue 37's TTFT p99 target of 5 s with room for the rows ahead of
    it to end. swap_ratio: how much longer a waiting adapter's queue must be than a held
    one's to drain the held one (2: chosen; 1 would drain for a tie). preempt: suspend a
    held adapter's rows for the oldest aged request waiting for a slot (see the module
    doc); min_run: how long the newest of those rows must have run since its first new
    token (1 s: chosen, so that a resumed row is not preempted again at once)."""

    max_wait: float = 3.0
    swap_ratio: float = 2.0
    copy: Copy = Copy.AHEAD
    preempt: bool = False
    min_run: float = 1.0


@dataclass(frozen=True)
class Plan:
    """admit: request ids to add, in order (aged, resident, swapped); prefetch: adapters to
    copy into a slot now; draining: held adapters whose new requests wait; preempt: held
    adapters whose running rows are to be suspended now (the caller plans again after)."""

    admit: tuple[str, ...] = ()
    prefetch: tuple = ()
    draining: frozenset = frozenset()
    preempt: tuple = ()


def admit(
    queue: Sequence[Waiting], slots: Slots, free_rows: int, now: float, policy: AdmissionPolicy
) -> Plan:
    """The plan for the next step (see the module doc); `queue` in arrival order."""
    held = {a for a, n in slots.running.items() if n > 0 and a is not None}
    taken = held | set(slots.pinned) | set(slots.loading)
    admitted: list[str] = []
    aged = [w for w in queue if now - w.arrived >= policy.max_wait]
    for i, w in enumerate(aged):
        if free_rows == 0:  # the oldest waits for a row: its adapter is copied meanwhile
            ahead = _copy_for_the_oldest(w.adapter, slots, taken, policy)
            return Plan(tuple(admitted), ahead, frozenset())
        if not _fits(w.adapter, taken, slots.num_slots):
            plan = _blocked(queue, aged[i:], slots, held, taken, free_rows, admitted)
            victim = _victim(queue, slots, held, now, policy) if policy.preempt else None
            if victim is None:
                return plan
            return Plan(plan.admit, (), plan.draining | {victim}, (victim,))
        admitted.append(w.request_id)
        taken.add(w.adapter)
        free_rows -= 1
    rest = [w for w in queue if now - w.arrived < policy.max_wait]
    draining = _draining(rest, slots, held, taken, policy)
    for w in rest:
        if free_rows == 0:
            break
        if w.adapter is None or (w.adapter in taken and w.adapter not in draining | slots.loading):
            admitted.append(w.request_id)
            free_rows -= 1
    joined = set(admitted)
    left = [w for w in rest if w.request_id not in joined and w.adapter not in draining]
    prefetch = _slots_for_groups(left, slots, taken, free_rows, policy, admitted)
    return Plan(tuple(admitted), tuple(prefetch), frozenset(draining))


def _blocked(queue: Sequence[Waiting], blocked: list[Waiting], slots: Slots, held: set,
             taken: set, free_rows: int, admitted: list[str]) -> Plan:  # fmt: skip
    """Rule 1 when the oldest aged request waits for a slot: the held adapters to drain for
    it and the aged requests behind it that need a slot too (one each, oldest first, at
    most DRAINS_PER_SLOTS of the slots), and the requests that take no new slot (the base
    model, a held adapter not drained) joining meanwhile, oldest first. Nothing is copied
    ahead and no other slot is taken: each freed slot goes to the oldest aged request."""
    cold = list(dict.fromkeys(w.adapter for w in blocked if w.adapter not in taken))
    waiting = Counter(w.adapter for w in queue)
    drainable = sorted((a for a in held if a not in slots.pinned),
                       key=lambda a: (waiting[a], slots.running.get(a, 0), str(a)))  # fmt: skip
    draining = frozenset(drainable[: min(len(cold), max(1, slots.num_slots // DRAINS_PER_SLOTS))])
    joined = set(admitted)
    for w in queue:
        if free_rows == 0:
            break
        if w.request_id in joined:
            continue
        if w.adapter is None or (w.adapter in taken and w.adapter not in draining | slots.loading):
            admitted.append(w.request_id)
            free_rows -= 1
    return Plan(tuple(admitted), (), draining)


def _copy_for_the_oldest(adapter, slots: Slots, taken: set, policy: AdmissionPolicy) -> tuple:
    """The oldest aged request's adapter to copy ahead while it waits for a row: one in no
    slot, copyable, with a slot to take now (the least recently used idle adapter makes
    room, whatever waits for it: the oldest request goes first)."""
    if (policy.copy is not Copy.AHEAD or adapter is None or adapter in taken
            or adapter in slots.resident or adapter in slots.uncopyable
            or len(taken) >= slots.num_slots):  # fmt: skip
        return ()
    return (adapter,)


def _victim(queue: Sequence[Waiting], slots: Slots, held: set, now: float,
            policy: AdmissionPolicy):  # fmt: skip
    """The held adapter whose rows are suspended for the oldest aged request (None: none
    may be): not pinned, its newest row run min_run; the fewest running rows, then the
    fewest waiting requests, first."""
    waiting = Counter(w.adapter for w in queue)
    ready = [a for a in held if a not in slots.pinned
             and now - slots.started.get(a, float("-inf")) >= policy.min_run]  # fmt: skip
    if not ready:
        return None
    return min(ready, key=lambda a: (slots.running.get(a, 0), waiting[a], str(a)))


DRAINS_PER_SLOTS = 2  # at most half the slots drained at once for aged requests: chosen


def _fits(adapter: Adapter | None, taken: set, num_slots: int) -> bool:
    return adapter is None or adapter in taken or len(taken) < num_slots


def _slots_for_groups(left: list[Waiting], slots: Slots, taken: set, free_rows: int,
                      policy: AdmissionPolicy, admitted: list[str]) -> list:  # fmt: skip
    """Rule 3: the groups that need a slot, best score first; appends the requests that
    join now to `admitted` and returns the adapters to copy ahead."""
    groups: dict[Adapter, list[Waiting]] = {}
    for w in left:
        if w.adapter not in taken and w.adapter is not None:
            groups.setdefault(w.adapter, []).append(w)
    resident = set(slots.resident)

    def rank(item):
        adapter, group = item
        weight = policy.swap_ratio if adapter in resident else 1.0
        return (-len(group) * weight, adapter not in resident, group[0].arrived)

    prefetch = []
    for adapter, group in sorted(groups.items(), key=rank):
        if adapter in resident:
            if free_rows == 0 or len(taken) >= slots.num_slots:
                continue
        elif not _spare_slot(slots, taken, [rank((a, g)) for a, g in groups.items()
                                            if a in resident and a not in taken],
                             rank((adapter, group))):  # fmt: skip
            continue
        elif policy.copy is Copy.AHEAD and adapter not in slots.uncopyable:
            prefetch.append(adapter)
            taken.add(adapter)
            continue
        elif free_rows == 0:
            continue
        group = group[:free_rows]
        admitted.extend(w.request_id for w in group)
        free_rows -= len(group)
        taken.add(adapter)
    return prefetch


def _spare_slot(slots: Slots, taken: set, idle_queues: list, mine: tuple) -> bool:
    """A slot a new adapter may take now: fewer than L adapters taken, and either a slot
    no adapter occupies or every idle adapter with requests waiting (`idle_queues`, their
    ranks) ranked below it (the slot manager evicts the least recently used idle one,
    whichever it is)."""
    if len(taken) >= slots.num_slots:
        return False
    if len((set(slots.resident) | taken) - {None}) < slots.num_slots:
        return True
    return all(other > mine for other in idle_queues)


def _draining(rest: list[Waiting], slots: Slots, held: set, taken: set,
              policy: AdmissionPolicy) -> set:  # fmt: skip
    """Rule 4: the held adapter to drain ({} or one), when every slot is taken and an
    adapter in no slot has a queue more than `swap_ratio` times the held one's."""
    if len(taken) < slots.num_slots:
        return set()
    queues = Counter(w.adapter for w in rest)
    cold = [n for a, n in queues.items() if a is not None and a not in taken]
    drainable = [a for a in held if a not in slots.pinned]
    if not cold or not drainable:
        return set()
    victim = min(drainable, key=lambda a: (queues[a], slots.running.get(a, 0), str(a)))
    return {victim} if max(cold) > policy.swap_ratio * max(queues[victim], 1) else set()
