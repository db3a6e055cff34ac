"""Prometheus metrics of the server, written in the text exposition format (no dependency).

Counters: requests started (they passed the engine's check) and requests ended by the
reason their client read (stop, length, cancelled, error: every started request ends in
exactly one), requests refused before they started, prompt and generated tokens, runtime
adapter loads and unloads, adapter copies into slots and slot evictions; gauges: requests
queued, rows running; histograms: time to first token and inter-token latency. The
scheduler thread and the readers write, the /metrics handler reads (one lock).
"""

from __future__ import annotations

import threading
from collections import Counter

# Bucket bounds in seconds, vLLM's for the same two histograms (chosen there to span a fast
# GPU decode step of a few ms to a long queue wait).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class Histogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float) -> None:
        index = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[index] += 1
        self.total += value

    def lines(self, name: str) -> list[str]:
        out, running = [f"# TYPE {name} histogram"], 0
        for bound, count in zip((*self.bounds, "+Inf"), self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        return [*out, f"{name}_sum {self.total}", f"{name}_count {running}"]


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # finish reason -> requests
        self.started_requests = 0
        self.refused_requests = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.adapter_loads = 0
        self.adapter_unloads = 0
        self.queued = 0
        self.running = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def set_load(self, queued: int, running: int) -> None:
        self.queued, self.running = queued, running

    def started(self, prompt_tokens: int) -> None:
        """A request passed the engine's check: it is counted again when it ends."""
        with self._lock:
            self.started_requests += 1
            self.prompt_tokens += prompt_tokens

    def refused(self) -> None:
        """A request refused before it started (the engine's check, a shutdown)."""
        with self._lock:
            self.refused_requests += 1

    def token(self, since: float, previous: float | None) -> None:
        """A generated token, `since` seconds after the last one (or the submission)."""
        with self._lock:
            self.generation_tokens += 1
            (self.ttft if previous is None else self.itl).observe(since)

    def finished(self, reason: str) -> None:
        with self._lock:
            self.requests[reason] += 1

    def adapter(self, loaded: bool) -> None:
        with self._lock:
            if loaded:
                self.adapter_loads += 1
            else:
                self.adapter_unloads += 1

    def render(self, slot_loads: int, evictions: int) -> str:
        """The exposition text; adapter copies into slots and evictions from the slot
        manager's counters."""
        with self._lock:
            lines = ["# TYPE moelora_requests_total counter"]
            lines += [f'moelora_requests_total{{finish_reason="{r}"}} {n}'
                      for r, n in sorted(self.requests.items())]  # fmt: skip
            for name, kind, value in (
                ("requests_started_total", "counter", self.started_requests),
                ("requests_refused_total", "counter", self.refused_requests),
                ("prompt_tokens_total", "counter", self.prompt_tokens),
                ("generation_tokens_total", "counter", self.generation_tokens),
                ("adapter_loads_total", "counter", self.adapter_loads),
                ("adapter_unloads_total", "counter", self.adapter_unloads),
                ("adapter_slot_loads_total", "counter", slot_loads),
                ("adapter_evictions_total", "counter", evictions),
                ("requests_queued", "gauge", self.queued),
                ("rows_running", "gauge", self.running),
            ):
                lines += [f"# TYPE moelora_{name} {kind}", f"moelora_{name} {value}"]
            lines += self.ttft.lines("moelora_time_to_first_token_seconds")
            lines += self.itl.lines("moelora_inter_token_latency_seconds")
        return "\n".join(lines) + "\n"
