"""Compiling ahead (moelora/kernels/compile_ahead.py): launches recorded instead of run, in
the recording thread only, each with its arguments named; compile_all hands each recorded
JIT launch to Triton's own launch path (warmup) under its AsyncCompileMode, so that the
compiles of all variants run in a thread pool. The engine's use (every step's launches
recorded before the captures, rows exact after) is in tests/test_mixed_graphs.py; the
compile itself needs a GPU (scripts/gpu_model_level.sh reports the startup)."""

from __future__ import annotations

import threading

import torch

from moelora.kernels import compile_ahead
from moelora.kernels.dense_lora import add_dense_lora


def _lora_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(5, 24, generator=g)
    x = torch.randn(5, 16, generator=g)
    slots = torch.tensor([1, -1, 0, 1, 0], dtype=torch.int32)
    a, bt = torch.randn(2, 4, 16, generator=g), torch.randn(2, 4, 24, generator=g)
    return out, x, slots, a, bt


def test_a_recorded_launch_does_not_run_and_names_its_arguments():
    out, x, slots, a, bt = _lora_case(1)
    before, launches = out.clone(), []
    with compile_ahead.recording(lambda fn, grid, kw: launches.append((fn, grid, kw))):
        add_dense_lora(out, x, slots, a, bt)
    assert torch.equal(out, before)  # nothing ran: out as it was, bit for bit
    ((fn, _, kw),) = launches
    assert fn.arg_names[0] in kw and all(name in kw for name in fn.arg_names[:5])
    assert any(v is out for v in kw.values()) and any(v is x for v in kw.values())
    add_dense_lora(out, x, slots, a, bt)  # the kernel back in place after the block: it runs
    assert not torch.equal(out, before)


def test_other_threads_launches_run_while_one_thread_records():
    want, x, slots, a, bt = _lora_case(2)
    add_dense_lora(want, x, slots, a, bt)
    got = _lora_case(2)[0]
    inside, done, launches = threading.Event(), threading.Event(), []

    def other():
        inside.wait(10)
        add_dense_lora(got, x, slots, a, bt)
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with compile_ahead.recording(lambda fn, grid, kw: launches.append(fn)):
        inside.set()
        assert done.wait(60), "the other thread's launch did not return"
        add_dense_lora(_lora_case(3)[0], x, slots, a, bt)  # this thread's: recorded
    thread.join()
    assert torch.equal(got, want) and len(launches) == 1


def test_compile_all_warms_each_jit_launch_in_triton_async_mode(monkeypatch):
    """Each JIT launch goes to the kernel's warmup while Triton's AsyncCompileMode is active
    over a pool of `workers` threads; each distinct kernel it returns gets its launcher built
    in the pool; a compile that fails is left to its first launch and leaves no mode set
    behind (Triton 3.6's __exit__ would: later compiles would go to the shut-down pool)."""
    import inspect

    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction

    seen, built = [], []
    compiled = type("Compiled", (), {})
    kernels = {16: compiled(), 32: compiled()}

    class Stand(JITFunction):  # a JIT kernel whose warmup records what Triton would compile
        def warmup(self, *args, grid, **kwargs):
            mode = _async_compile.active_mode.get()
            seen.append((grid, kwargs, mode is not None and mode.executor._max_workers))
            if kwargs["BLOCK"] == 64:  # a compile that raises, submitted as Triton does

                def fail():
                    raise RuntimeError("ptxas error")

                extra = [lambda k: None] * (len(inspect.signature(mode.submit).parameters) - 2)
                return mode.submit("failing", fail, *extra)
            return kernels[kwargs["BLOCK"]]

    monkeypatch.setattr(compile_ahead, "_build_launcher", built.append)
    stand = Stand.__new__(Stand)
    interpreted = type("Interpreted", (), {})()  # not a JITFunction (the interpreter's): skipped
    launches = [(stand, (4,), {"x": 1, "BLOCK": 16}), (interpreted, (1,), {"x": 2}),
                (stand, (8, 2), {"x": 3, "BLOCK": 32}), (stand, (4,), {"x": 5, "BLOCK": 16}),
                (stand, (1,), {"x": 4, "BLOCK": 64})]  # fmt: skip
    assert compile_ahead.compile_all(launches, workers=3) == 4
    assert [s[:2] for s in seen] == [(g, kw) for f, g, kw in launches if f is stand]
    assert {s[2] for s in seen} == {3}
    assert sorted(map(id, built)) == sorted(map(id, kernels.values()))  # once each
    assert _async_compile.active_mode.get() is None
    assert compile_ahead.compile_all([(interpreted, (1,), {})]) == 0


def test_wanted_on_cuda_unless_turned_off(monkeypatch):
    monkeypatch.delenv("MOELORA_COMPILE_AHEAD", raising=False)
    assert compile_ahead.wanted(torch.device("cuda", 0))
    assert not compile_ahead.wanted(torch.device("cpu"))
    monkeypatch.setenv("MOELORA_COMPILE_AHEAD", "0")
    assert not compile_ahead.wanted(torch.device("cuda", 0))


def test_distinct_keeps_one_launch_a_variant():
    """Launches alike in what Triton specializes on (scalars; a tensor's dtype and 16-byte
    alignment, not its sizes) are kept once; any difference keeps both."""
    kept = compile_ahead.Distinct()
    k1, k2 = object(), object()
    x, y = torch.empty(8, 64), torch.empty(3, 64)
    kept.add(k1, (1,), {"x": x, "n": 64, "eps": 1e-6})
    kept.add(k1, (9,), {"x": y, "n": 64, "eps": 1e-6})  # another layer's tensors, sizes
    assert len(kept.launches) == 1 and kept.launches[0][2]["x"] is x
    kept.add(k1, (1,), {"x": x, "n": 65, "eps": 1e-6})  # a scalar differs
    kept.add(k1, (1,), {"x": x.half(), "n": 64, "eps": 1e-6})  # the dtype
    kept.add(k1, (1,), {"x": x.view(-1)[1:], "n": 64, "eps": 1e-6})  # 4 bytes in: unaligned
    kept.add(k2, (1,), {"x": x, "n": 64, "eps": 1e-6})  # another kernel
    descriptor = object()
    kept.add(k1, (1,), {"x": x, "n": 64, "eps": 1e-6, "d": descriptor})
    kept.add(k1, (1,), {"x": x, "n": 64, "eps": 1e-6, "d": object()})  # never merged
    assert kept.seen == 8 and len(kept.launches) == 7
