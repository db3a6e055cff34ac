"""A fork / join of work onto a second CUDA stream of the same device (TileConfig.lora_stream).

The down LoRA branch (z shrink, then its expand into delta rows) depends on z only, and the
LoRA-free down GEMM does not need it: the branch runs on a side stream while the GEMM runs
on the caller's stream, and the caller's stream waits for the branch before the top-k
reduce adds its delta. Under CUDA-graph capture the fork and the join are the graph's own
edges (the side stream joins the capture through the fork's event wait), and the branch's
workspaces come from the graph's pool like the rest.

Memory across the streams without `record_stream`: the side stream waits for the caller's
stream before the branch (everything the branch reads is written by then) and the caller's
stream waits for the branch before anything after the join, so every later use or reuse of
a tensor either stream touched here is ordered after the branch on both streams. The
caching allocator reuses a freed block only on the stream that allocated it, and the next
fork orders that stream after the caller's stream again.

Priority: the side stream is created at the device's highest priority, so that the
branch's programs are dispatched ahead of the GEMM's as SMs free up (its work is short and
the reduce waits for it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        high, _ = torch.cuda.Stream.priority_range()
        _STREAMS[index] = torch.cuda.Stream(device=index, priority=high)
    return _STREAMS[index]


class Branch:
    """Work forked onto the side stream: `run` it once, `join` before using its result."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.main = torch.cuda.current_stream(device) if self.cuda else None
        self.side = _side(device) if self.cuda else None
        self.result = None
        self.joined = not self.cuda  # off the GPU the work runs inline: nothing to join

    def run(self, work: Callable[[], object]) -> None:
        """Run `work` on the side stream (inline off the GPU); its return value is `result`."""
        if not self.cuda:
            self.result = work()
            return
        self.side.wait_stream(self.main)  # the fork: the branch sees everything before it
        self.joined = False  # from here on the caller's stream must wait, even if work raises
        with torch.cuda.stream(self.side):
            self.result = work()

    def join(self) -> None:
        """The caller's stream waits for the branch (once; later calls do nothing)."""
        if not self.joined:
            self.main.wait_stream(self.side)
            self.joined = True


@contextmanager
def side_stream(device: torch.device) -> Iterator[Branch]:
    """A Branch on `device`, joined on exit whether or not the caller joined it (an error
    between the fork and the join still leaves the streams ordered)."""
    branch = Branch(device)
    try:
        yield branch
    finally:
        branch.join()
