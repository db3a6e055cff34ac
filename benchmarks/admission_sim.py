"""What the adapter-aware admission policy gives under a serving load, simulated on the CPU:
moelora/serve/admission.py's plans driven step by step through a model of the engine and the
slot manager (rows that end after their output lengths, LRU slots that evict only an adapter
no running row holds, copies ahead that take a few steps), on serve_load's workload (Poisson
arrivals, a client concurrency cap, output lengths, adapter names drawn Zipf from more names
than slots). It prints each configuration's TTFT p50 / p99 (queue wait: prefill and copies
are not modelled) and the run's length, for several slot counts and, with --preempt, the
policy with AdmissionPolicy.preempt (a held adapter's rows suspended for a request that has
waited max_wait for a slot; they rejoin the queue and resume by recompute).

    python -m benchmarks admission_sim                       # the BENCHMARKS.md figures
    python -m benchmarks admission_sim --slots 8,32 --seeds 5

The model is the property test's (tests/test_serve_admission.py uses `SlotModel`): a
simulation for choosing a policy, not a measurement of the server.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from dataclasses import dataclass, field

from moelora.serve.admission import AdmissionPolicy, Copy, Slots, Waiting, admit

MAX_STEPS = 1_000_000  # a simulation past this many steps has starved a request


@dataclass
class SlotModel:
    """The engine and slot manager the policy plans for, one step per plan."""

    num_slots: int
    rows: int
    copy_steps: int
    resident: list = field(default_factory=list)  # LRU first
    loading: dict = field(default_factory=dict)  # adapter -> step its copy ends
    running: dict = field(default_factory=dict)  # request id -> (adapter, last step)
    copied_at_add: int = 0

    def held(self) -> set:
        return {a for a, _ in self.running.values() if a is not None} | set(self.loading)

    def claim(self, adapter):
        """A slot for `adapter`: a free one, else the LRU adapter no row holds (the slot
        manager's choose_slot); the policy must never leave none."""
        if len(self.resident) + len(self.loading) < self.num_slots:
            return None
        idle = [a for a in self.resident if a not in self.held()]
        assert idle, f"no slot for {adapter}: every slot held {self.resident} {self.loading}"
        self.resident.remove(idle[0])
        return idle[0]

    def use(self, adapter) -> None:
        """A row of `adapter` starts: in a slot now (copied here if it is in none)."""
        if adapter is None:
            return
        if adapter in self.loading:  # an aged request: add() waits for the copy
            del self.loading[adapter]
        elif adapter not in self.resident:
            self.claim(adapter)
            self.copied_at_add += 1
        if adapter in self.resident:
            self.resident.remove(adapter)
        self.resident.append(adapter)

    def arrive(self, step: int) -> None:
        """Copies ahead that ended by `step` are resident."""
        for a in [a for a, end in self.loading.items() if end <= step]:
            del self.loading[a]
            self.resident.append(a)

    def slots(self, began: dict | None = None) -> Slots:
        """The slots as the policy reads them; began: request id -> step its row joined
        (its first new token two steps later: a resumed row's first step recomputes)."""
        running = Counter(a for a, _ in self.running.values() if a is not None)
        started: dict = {}
        for r, (a, _) in self.running.items():
            if began is not None and a is not None:
                started[a] = max(started.get(a, began[r] + 2), began[r] + 2)
        return Slots(self.num_slots, frozenset(self.resident), running,
                     loading=frozenset(self.loading), started=started)  # fmt: skip


def simulate(seed: int, *, names: int = 32, slots: int = 8, rows: int = 64,
             concurrency: int = 64, requests: int = 256, rate: float = 32.0,
             step_s: float = 0.025, zipf: float = 1.0, output: tuple = (32, 256),
             max_wait_s: float = 3.0, copy_steps: int = 2, preempt: bool = False,
             min_run_s: float = 1.0, max_steps: int = MAX_STEPS) -> dict:  # fmt: skip
    """One run: TTFT p50 / p99 (seconds of queue wait before a request's first step), the
    run's seconds and the preemptions. preempt: AdmissionPolicy.preempt (the policy names
    the adapter whose rows are suspended; they rejoin the queue, waiting anew)."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** zipf for i in range(names)]
    t, arrivals = 0.0, []
    for _ in range(requests):
        t += rng.expovariate(rate * step_s)
        arrivals.append((int(t), rng.choices(range(names), weights)[0], rng.randint(*output)))
    max_wait, min_run = round(max_wait_s / step_s), round(min_run_s / step_s)
    policy = AdmissionPolicy(max_wait=max_wait, swap_ratio=2, copy=Copy.AHEAD,
                             preempt=preempt, min_run=min_run)  # fmt: skip
    model = SlotModel(slots, rows, copy_steps)
    left = {f"r{i}": n for i, (_, _, n) in enumerate(arrivals)}
    adapter_of = {f"r{i}": a for i, (_, a, _) in enumerate(arrivals)}
    queue: list[Waiting] = []
    sent, first, began = {}, {}, {}
    nxt = inflight = done = preemptions = 0
    step = 0
    while done < requests:
        while nxt < requests and arrivals[nxt][0] <= step and inflight < concurrency:
            rid = f"r{nxt}"
            sent[rid] = step
            queue.append(Waiting(rid, adapter_of[rid], step))
            inflight, nxt = inflight + 1, nxt + 1
        model.arrive(step)
        plan = admit(queue, model.slots(began), rows - len(model.running), step, policy)
        for victim in plan.preempt:  # suspended: back in the queue, waiting anew
            for r in [r for r, (a, _) in model.running.items() if a == victim]:
                left[r] = model.running.pop(r)[1] - step + 1  # its tokens left, + recompute
                queue.insert(0, Waiting(r, victim, step))
                preemptions += 1
        if plan.preempt:
            plan = admit(queue, model.slots(began), rows - len(model.running), step, policy)
        for rid in plan.admit:
            model.use(adapter_of[rid])
            model.running[rid] = (adapter_of[rid], step + left[rid])
            began[rid] = step
            first.setdefault(rid, step)
        for a in plan.prefetch:
            model.claim(a)
            model.loading[a] = step + copy_steps
        joined = set(plan.admit)
        queue = [w for w in queue if w.request_id not in joined]
        ended = [r for r, (_, end) in model.running.items() if end <= step + 1]
        for r in ended:
            del model.running[r]
        inflight, done, step = inflight - len(ended), done + len(ended), step + 1
        if step > max_steps:
            raise RuntimeError(f"{requests - done} requests never finished: a starved queue")
    waits = sorted((first[r] - sent[r]) * step_s for r in first)

    def q(p: float) -> float:
        return waits[min(len(waits) - 1, int(p * len(waits)))]

    return {"seed": seed, "slots": slots, "preempt": preempt, "ttft_p50_s": round(q(0.5), 2),
            "ttft_p99_s": round(q(0.99), 2), "run_s": round(step * step_s, 1),
            "preemptions": preemptions}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", default="8,16,32", help="slot counts, comma-separated")
    p.add_argument("--names", type=int, default=32)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=25.0, help="one decode step (c64: ~25 ms)")
    p.add_argument("--max-wait", type=float, default=3.0, help="seconds (AdmissionPolicy's)")
    p.add_argument("--preempt", action=argparse.BooleanOptionalAction, default=True,
                   help="also the preempting policy at the first slot count")  # fmt: skip
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    common = dict(names=a.names, requests=a.requests, concurrency=a.concurrency,
                  rows=a.concurrency, step_s=a.step_ms / 1e3, max_wait_s=a.max_wait)  # fmt: skip
    counts = [int(n) for n in a.slots.split(",")]
    configs = [(n, False) for n in counts] + ([(counts[0], True)] if a.preempt else [])
    rows = []
    for n, preempt in configs:
        runs = [simulate(seed, slots=n, preempt=preempt, **common) for seed in range(a.seeds)]
        rows += runs
        label = f"{n} slots" + (", preempting" if preempt else "")
        cells = " | ".join(f"p50 {r['ttft_p50_s']:.2f} p99 {r['ttft_p99_s']:.2f} run "
                           f"{r['run_s']:.1f} s pre {r['preemptions']}" for r in runs)  # fmt: skip
        print(f"{label:<22} {cells}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
