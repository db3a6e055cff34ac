"""A ParallelMoELoRALayer's collectives, logged, replayed alone, or left out
(scripts/parallel_bench.py times the layer, its collectives alone and its compute alone).

The layer issues them through two seams: `comm` (fully sharded LoRA's all-gather and
all-reduce over the TP group, a LoRAComm) and `reduce_output` (the output all-reduce over the
world). Each view below is a shallow copy of the layer (the same shards) with those replaced.
"""

from __future__ import annotations

import copy
from collections import Counter

import torch

from moelora.parallel import ParallelMoELoRALayer

Op = tuple[str, tuple[int, ...], torch.dtype]  # (seam method, shape, dtype)


class LocalComm:
    """LoRAComm without communication: the same shapes out, this rank's values only."""

    def __init__(self, tp: int, hidden_offset: int) -> None:
        self.tp, self.hidden_offset = tp, hidden_offset

    def gather_rank(self, u: torch.Tensor) -> torch.Tensor:
        return torch.cat([u] * self.tp, dim=-1)  # DistComm concatenates the gathered pieces too

    def reduce_rank(self, v: torch.Tensor) -> torch.Tensor:
        return v


class RecordingComm:
    """A LoRAComm that logs every collective, then issues it."""

    def __init__(self, inner, log: list[Op]) -> None:
        self.inner, self.log, self.hidden_offset = inner, log, inner.hidden_offset

    def gather_rank(self, u: torch.Tensor) -> torch.Tensor:
        self.log.append(("gather_rank", tuple(u.shape), u.dtype))
        return self.inner.gather_rank(u)

    def reduce_rank(self, v: torch.Tensor) -> torch.Tensor:
        self.log.append(("reduce_rank", tuple(v.shape), v.dtype))
        return self.inner.reduce_rank(v)


def recording(layer: ParallelMoELoRALayer, log: list[Op]) -> ParallelMoELoRALayer:
    """The layer, logging into `log` each collective it issues."""
    view = copy.copy(layer)
    view.comm = None if layer.comm is None else RecordingComm(layer.comm, log)

    def reduce_output(y: torch.Tensor) -> None:
        log.append(("reduce_output", tuple(y.shape), y.dtype))
        layer.reduce_output(y)

    view.reduce_output = reduce_output
    return view


def without_collectives(layer: ParallelMoELoRALayer) -> ParallelMoELoRALayer:
    """The layer's kernels on the same shapes, no collective (its output is not the layer's)."""
    view = copy.copy(layer)
    if layer.comm is not None:
        view.comm = LocalComm(layer.layout.tp, layer.comm.hidden_offset)
    view.reduce_output = lambda y: None
    return view


def replay(layer: ParallelMoELoRALayer, log: list[Op], device: torch.device):
    """A call issuing the logged collectives alone, through the layer's own seams, on zero
    buffers of the logged shapes and dtypes."""
    ops = {"reduce_output": layer.reduce_output}
    if layer.comm is not None:
        ops |= {"gather_rank": layer.comm.gather_rank, "reduce_rank": layer.comm.reduce_rank}
    bufs = [(ops[op], torch.zeros(shape, dtype=dtype, device=device)) for op, shape, dtype in log]

    def call() -> None:
        for op, buf in bufs:
            op(buf)

    return call


def describe(log: list[Op]) -> dict:
    """JSON-ready: each distinct collective with its count, and the bytes one forward sends
    into them (each rank's input sizes)."""
    counts = Counter(log)
    ops = [
        dict(op=op, shape=list(shape), dtype=str(dtype), count=n)
        for (op, shape, dtype), n in counts.items()
    ]
    nbytes = sum(torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype in log)
    return dict(collectives=ops, collective_bytes=nbytes)
