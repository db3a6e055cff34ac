"""Whole decode steps as CUDA graphs, one per bucket of rows (vLLM's cudagraph capture sizes).

An eager decode step of a MoE model is bound by Python launches (hundreds of kernels per
step); a replay is one launch. The engine keeps every input of a decode step in static
buffers (token ids, positions, row slots, the cache), so the graph of bucket b decodes cache
rows 0 .. b-1: a step with r running rows replays the smallest bucket >= r, the rows in
between being padding (slot -1, token 0, position 0 of a free cache row). Buckets are
captured at first use or all up front (`capture_all`, largest first: the smaller ones reuse
its memory pool). `capture` is a module attribute so CPU tests swap in a stand-in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import cuda_graphs
from ..errors import ConfigError

log = logging.getLogger("moelora.engine")

# vLLM's default capture sizes up to 64 (powers of two): a step pads at most 2x its rows.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def buckets_for(max_rows: int) -> tuple[int, ...]:
    """The capture sizes for an engine of max_rows rows: BUCKETS below it, then max_rows."""
    return (*(b for b in BUCKETS if b < max_rows), max_rows)


@dataclass(frozen=True)
class CaptureReport:
    """What a capture_all took: buckets captured and wall seconds; prompt_buckets: the
    token buckets of the unified steps with prompt chunks (mixed_graphs.py), when captured
    in the same warm-up."""

    buckets: tuple[int, ...]
    seconds: float
    prompt_buckets: tuple[int, ...] = ()

    def __str__(self) -> str:
        prompts = (f"; prompt steps: {list(self.prompt_buckets)} tokens"
                   if self.prompt_buckets else "")  # fmt: skip
        return (f"decode graphs: buckets {list(self.buckets)}{prompts} captured in "
                f"{self.seconds:.1f} s")  # fmt: skip


class CaptureFailed(RuntimeError):
    """A step could not be captured (its warm-up run or the capture raised)."""


@dataclass
class Graph:
    """One captured step: replay() runs it, out is the tensor it writes (logits [b, V])."""

    replay: Callable[[], None]
    out: Tensor


def capture_cuda(step: Callable[[], Tensor], pool) -> Graph:
    """Capture step() (which reads and writes static buffers only) as a CUDA graph, after a
    warm-up run; other threads (other engines, adapter loads) keep launching meanwhile."""
    if not torch.cuda.is_available():
        raise ConfigError(
            "enforce_eager", False, "None or True on a machine without CUDA (graphs need it)"
        )
    captured = cuda_graphs.capture(step, pool=pool, thread_local=True)
    return Graph(captured.replay, captured.out)


capture = capture_cuda  # swapped for a stand-in by CPU tests


class StepGraphs:
    """The graphs of one engine. step(b) runs the decode step of bucket b from the static
    buffers the engine has filled; prepare(b) fills them with padding rows only. buckets:
    other sizes than buckets_for(max_rows) (mixed_graphs.py's token buckets); unit: what
    a bucket counts, for the log."""

    def __init__(
        self,
        max_rows: int,
        step: Callable[[int, frozenset[str]], Tensor],
        buckets: tuple[int, ...] | None = None,
        unit: str = "decode graph of %d rows",
    ) -> None:
        self.buckets = buckets_for(max_rows) if buckets is None else tuple(buckets)
        self.unit = unit
        self._step = step
        self._graphs: dict[tuple[int, frozenset[str]], Graph] = {}
        self._pool = None

    @property
    def captured(self) -> tuple[int, ...]:
        """The buckets captured (for any module set)."""
        return tuple(sorted({bucket for bucket, _ in self._graphs}))

    def bucket(self, rows: int) -> int:
        """The smallest bucket holding `rows` rows (rows <= max_rows)."""
        return next(b for b in self.buckets if b >= rows)

    def has(self, bucket: int, modules: frozenset[str] = frozenset()) -> bool:
        """Whether the graph of (bucket, modules) is captured."""
        return (bucket, modules) in self._graphs

    def run(self, bucket: int, modules: frozenset[str] = frozenset()) -> Tensor:
        """Replay the graph of (bucket, the served modules with LoRA in the step), captured
        now if new; the buffers hold this step's inputs, so the capture's warm-up run is this
        very step, repeated by the replay (harmless for a KV write; a step that advances
        state, as linear attention does, captures on padding first: capture())."""
        graph = self._graphs.get((bucket, modules))
        if graph is None:
            graph = self.capture(bucket, modules)
        graph.replay()
        return graph.out

    def capture(self, bucket: int, modules: frozenset[str] = frozenset()) -> Graph:
        """Capture the graph of (bucket, modules) from what the buffers hold now (its
        warm-up run runs that step once)."""
        start = time.perf_counter()
        graph = self._capture(bucket, modules)
        log.info(self.unit + " captured in %.2f s", bucket, time.perf_counter() - start)
        return graph

    def capture_all(
        self, prepare: Callable[[int], None], modules: frozenset[str] = frozenset()
    ) -> CaptureReport:
        """Capture every bucket not yet captured for `modules` (the served modules with
        LoRA), largest first; prepare(b) fills the static buffers with padding for b rows."""
        start = time.perf_counter()
        done = {bucket for bucket, mods in self._graphs if mods == modules}
        for bucket in sorted(set(self.buckets) - done, reverse=True):
            prepare(bucket)
            self._capture(bucket, modules)
        report = CaptureReport(self.captured, time.perf_counter() - start)
        log.info("%s", report)
        return report

    def _capture(self, bucket: int, modules: frozenset[str]) -> Graph:
        if self._pool is None:
            self._pool = cuda_graphs.new_pool()
        try:
            graph = capture(lambda: self._step(bucket, modules), self._pool)
        except Exception as err:
            raise CaptureFailed(f"{self.unit % bucket}: {err!r}") from err
        self._graphs[bucket, modules] = graph
        return graph
