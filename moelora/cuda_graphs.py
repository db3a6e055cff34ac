"""The one way moelora captures a CUDA graph, and the flag that says a caller is graphing a
whole step (so the layers inside run inline instead of replaying graphs of their own).

`capture(step)` runs step() once on a side stream (Triton compiles, lazy allocations and
autotuning happen outside the capture), then captures a second call; the graph reads and
writes the tensors step() reads and writes, and `out` is what the captured call returned.
Used by the decode engine's step graphs, the experts' per-layer graphs, the bench timer and
the slot-manager GPU check. Imports torch only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

_inline = threading.local()


@dataclass
class Captured:
    """A captured graph: replay() runs it again; out is what the captured call returned."""

    graph: torch.cuda.CUDAGraph
    out: Any

    def replay(self) -> None:
        self.graph.replay()


def capture(
    step: Callable[[], Any], pool=None, thread_local: bool = False, warmups: int = 1
) -> Captured:
    """Capture step() as a CUDA graph, after `warmups` runs on a side stream. pool: a memory
    pool shared with other graphs (new_pool()); thread_local: other threads keep launching
    work while this one captures (engines, adapter loads)."""
    if warmups:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmups):
                step()
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    mode = "thread_local" if thread_local else "global"
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
        out = step()
    return Captured(graph, out)


def new_pool():
    """A memory pool graphs captured one after another may share (None without CUDA)."""
    return torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None


@contextmanager
def inline() -> Iterator[None]:
    """The calling thread graphs a whole step for the block: layers that keep graphs of
    their own run inline instead (their warm-up before a capture is not capturing, and would
    otherwise capture per-layer graphs no one replays)."""
    previous = getattr(_inline, "on", False)
    _inline.on = True
    try:
        yield
    finally:
        _inline.on = previous


def inlined() -> bool:
    """True inside inline() in this thread, or while this thread's stream is capturing."""
    return getattr(_inline, "on", False) or (
        torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    )
