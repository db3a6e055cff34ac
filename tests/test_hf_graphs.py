"""The decode-graph cache's policy (moelora/hf/graphs.py), on CPU with a stand-in for the
CUDA capture: a shape runs directly at its first call, is captured at its second, replayed
after that with the call's own inputs copied in; entries are per thread and bounded (LRU).
The capture itself runs on the GPU only (`moelora validate --suite hf`)."""

from __future__ import annotations

import threading

import pytest
import torch

from moelora import cuda_graphs
from moelora.hf import graphs


class _FakeGraph:
    def __init__(self, forward, static, out):
        self.forward, self.static, self.out = forward, static, out
        self.replays = 0

    def replay(self):
        self.out.copy_(self.forward(*self.static))
        self.replays += 1


@pytest.fixture
def cache(monkeypatch):
    captured = []

    def capture(forward, inputs):
        static = tuple(t.clone() for t in inputs)
        out = forward(*static)
        entry = graphs._Entry(_FakeGraph(forward, static, out), static, out)
        captured.append(entry)
        return entry

    monkeypatch.setattr(graphs.LayerGraphs, "_capture", staticmethod(capture))
    layer = graphs.LayerGraphs(max_tokens=8, max_graphs=2)
    layer.captured = captured
    return layer


def _forward(x, ids, w):
    return x * w.sum(-1, keepdim=True) + ids.sum(-1, keepdim=True)


def _inputs(t, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(t, 4, generator=g),
        torch.randint(0, 3, (t, 2), generator=g),
        torch.rand(t, 2, generator=g),
    )


def test_second_call_captures_and_replays_follow_the_inputs(cache):
    for call in range(5):
        x, ids, w = _inputs(3, seed=call)
        out = cache.run(_forward, x, ids, w, bank_key=0)
        assert torch.equal(out, _forward(x, ids, w)), call
        assert len(cache.captured) == (0 if call == 0 else 1)
    assert cache.captured[0].graph.replays == 4
    out.add_(1)  # the caller owns a copy, never the graph's output
    assert not torch.equal(out, cache.captured[0].out)


def test_bounded_and_per_thread(cache):
    for t in (1, 2, 3):  # three shapes, two captured at a time
        for seed in range(2):
            cache.run(_forward, *_inputs(t, seed), bank_key=0)
    assert len(cache._entries) == 2 and {k[1] for k in cache._entries} == {2, 3}
    results = []

    def other_thread():
        for seed in range(2):
            x, ids, w = _inputs(3, seed + 10)
            results.append(
                torch.equal(cache.run(_forward, x, ids, w, bank_key=0), _forward(x, ids, w))
            )

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    assert results == [True, True]
    assert len({k[0] for k in cache._entries}) == 2  # the other thread has its own entry


def test_not_used_on_cpu():
    layer = graphs.LayerGraphs(max_tokens=8)
    assert not layer.usable(torch.randn(4, 4))  # a CPU tensor


class _CudaLike:
    """Stands for a CUDA tensor of T rows: usable() reads is_cuda and shape only."""

    is_cuda = True

    def __init__(self, tokens: int) -> None:
        self.shape = (tokens, 4)


def test_inline_turns_layer_graphs_off_in_this_thread_only(monkeypatch):
    """The decode engine graphs whole steps: inside inline() no layer graph is used (its
    warm-up run would capture graphs no one replays); other threads and after: as before."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU build
    layer = graphs.LayerGraphs(max_tokens=8)
    assert layer.usable(_CudaLike(4)) and not layer.usable(_CudaLike(9))
    seen = []
    with cuda_graphs.inline():
        assert not layer.usable(_CudaLike(4))
        with cuda_graphs.inline():  # nested: still off, and restored only by the outer block
            pass
        assert not layer.usable(_CudaLike(4))
        worker = threading.Thread(target=lambda: seen.append(layer.usable(_CudaLike(4))))
        worker.start()
        worker.join()
    assert seen == [True] and layer.usable(_CudaLike(4))
