"""Timing one call on every rank of a process group (scripts/parallel_bench.py).

GPU: CUDA events around each call, the calls queued behind a spin kernel, so the host's launch
cost is hidden and the events measure the GPU's time (what a CUDA-graph replay approaches);
`host_bound` says when the spin ended before the host had queued every call (then the events
include gaps). Without the spin (`spin=False`): what an eager caller sees. CPU: wall time.
Each rank takes its own median; `slowest` gives the group's (the layer is done when its
slowest rank is).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

SPIN_PROBE_CYCLES = 20_000_000  # ~10 ms at an H200's ~1.98 GHz: long enough to time the spin
SPIN_MAX_MS = 2000.0  # a cap on one spin; host_bound still reports a spin that ran out


class Clock:
    """Median ms of `iters` calls after `warmup` calls at the same shapes."""

    def __init__(self, device: torch.device, iters: int, warmup: int) -> None:
        self.cuda = device.type == "cuda"
        self.iters, self.warmup = iters, max(warmup, 1 if self.cuda else 0)
        self.cycles_per_ms = _spin_rate() if self.cuda else 0.0

    def median(self, fn, *, spin: bool = True, barrier: bool = False) -> tuple[float, bool]:
        """(median ms, host_bound); barrier: every rank starts together (calls that hold
        collectives; the first timed call absorbs what skew is left)."""
        host_ms = 0.0
        for _ in range(self.warmup):
            start = time.perf_counter()
            fn()
            host_ms = (time.perf_counter() - start) * 1e3
        if self.cuda:
            torch.cuda.synchronize()
        if barrier:
            dist.barrier()
        if not self.cuda:
            return statistics.median(_wall_ms(fn) for _ in range(self.iters)), False
        events = [[torch.cuda.Event(enable_timing=True) for _ in "ab"] for _ in range(self.iters)]
        spun = torch.cuda.Event()
        if spin:  # the GPU spins while the host queues every call
            spin_ms = min(SPIN_MAX_MS, 2 * self.iters * host_ms + 1)
            torch.cuda._sleep(int(self.cycles_per_ms * spin_ms))
            spun.record()
        for a, b in events:
            a.record()
            fn()
            b.record()
        host_bound = spin and spun.query()  # the spin was over before the last call queued
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in events), host_bound


def _wall_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _spin_rate() -> float:
    """Cycles of torch.cuda._sleep per ms on this GPU, measured once."""
    torch.cuda._sleep(SPIN_PROBE_CYCLES // 10)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(SPIN_PROBE_CYCLES)
    b.record()
    b.synchronize()
    return SPIN_PROBE_CYCLES / a.elapsed_time(b)


def slowest(timing: tuple[float, bool], device: torch.device) -> tuple[float, bool]:
    """The slowest rank's median, and whether any rank's timing was host bound."""
    t = torch.tensor([timing[0], float(timing[1])], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[0].item(), bool(t[1].item())


def agree(flag: bool, device: torch.device) -> bool:
    """Rank 0's decision, on every rank (so that every rank takes the same branch)."""
    t = torch.tensor([int(flag)], device=device)
    dist.broadcast(t, src=0)
    return bool(t.item())
