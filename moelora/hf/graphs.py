"""CUDA graphs of one expert layer at small T (decode), captured and replayed.

In eager transformers a decode step is host-bound: each Triton launch costs ~0.19 ms of
Python on the H200 (docs/history/kernel_log.md, host side), three or more per MoE layer, while the layer's
GPU work at T = 1 is ~0.04 ms. A replay costs one launch. Per (thread, T, with / without
LoRA) an entry, made at the shape's second call (decode repeats it every step), holds
static inputs, a graph of the layer reading them, and its output; a
call copies its inputs in, replays, and returns a copy of the output. The slot banks are
the slot manager's own tensors (the same in every version), so a replay reads the adapters
the call's lease holds. Entries are per thread: two threads never share static inputs.
Not used while the caller itself captures a graph (the layer is captured inline then).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import cuda_graphs

# Largest T replayed from a graph. Decode batches; above it a forward's GPU work outweighs
# the host cost it saves (at T = 256 the layer's GPU time is ~0.44 ms, H200 bench).
MAX_GRAPH_TOKENS = 128
# A shape is captured at its second call: decode repeats its T every step, a short prefill's
# T (its prompt length) rarely repeats and would cost a capture for one use.
CAPTURE_AT_CALL = 2
# Graphs kept per layer (least recently used dropped, freeing its memory pool): a generate
# call uses one decode T; a few batch sizes in turn stay captured.
MAX_GRAPHS = 16


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[Tensor, ...]  # x, ids, weights[, slots]: the graph reads these
    out: Tensor


class LayerGraphs:
    """The graphs of one layer. run(...) returns None when the call is not graphed."""

    def __init__(self, max_tokens: int = MAX_GRAPH_TOKENS, max_graphs: int = MAX_GRAPHS) -> None:
        self.max_tokens, self.max_graphs = max_tokens, max_graphs
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._calls: Counter[tuple] = Counter()
        self._lock = threading.Lock()

    def usable(self, x: Tensor) -> bool:
        # not while the caller graphs a whole step (cuda_graphs.inline) or captures one
        return x.is_cuda and 0 < x.shape[0] <= self.max_tokens and not cuda_graphs.inlined()

    def run(self, forward: Callable[..., Tensor], *inputs: Tensor, bank_key: int) -> Tensor:
        """forward(*inputs) through a graph: inputs are x [T, H], ids [T, K] int32,
        weights [T, K] fp32 and, with LoRA, slots [T] int32; bank_key names the bank."""
        key = (threading.get_ident(), inputs[0].shape[0], len(inputs), bank_key, inputs[0].dtype)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            else:
                self._calls[key] += 1
                if self._calls[key] < CAPTURE_AT_CALL:
                    return forward(*inputs)  # first sight of this shape: run it directly
        if entry is None:
            entry = self._capture(forward, inputs)
            with self._lock:
                self._entries[key] = entry
                del self._calls[key]
                while len(self._entries) > self.max_graphs:
                    self._entries.popitem(last=False)
        for static, value in zip(entry.inputs, inputs):
            static.copy_(value)
        entry.graph.replay()
        return entry.out.clone()

    @staticmethod
    def _capture(forward: Callable[..., Tensor], inputs: tuple[Tensor, ...]) -> _Entry:
        static = tuple(t.clone() for t in inputs)
        captured = cuda_graphs.capture(lambda: forward(*static))
        return _Entry(captured.graph, static, captured.out)
