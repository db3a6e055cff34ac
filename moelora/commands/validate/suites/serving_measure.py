"""The measurements and checks of `moelora validate --suite serving` (serving.py runs them):
a loader thread pulling cold adapters through `reading()`, a stream of forwards under
leases, the host-to-device bandwidth they are set against, and the correctness checks.

Legend: T tokens per forward, H hidden, I intermediate, E experts, r an adapter's rank.
"""

from __future__ import annotations

import statistics
import threading
import time
from contextlib import nullcontext

import torch

from ....compare import compare
from ....lora import SlotManager
from ....reference import moe_lora_reference

FACTORS = ("w13_a", "w13_b", "w2_a", "w2_b")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def h2d_bandwidth(nbytes: int, reps: int, dev: torch.device) -> dict:
    """GB/s of a pinned host buffer of `nbytes` copied to `dev` on a side stream."""
    if dev.type != "cuda":
        return {"bytes": nbytes, "gb_s": None, "median_ms": None}
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)
    times = []
    with torch.cuda.stream(stream):
        for _ in range(reps + 2):  # two warm-up copies
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
    median_ms = statistics.median(times[2:])
    return {"bytes": nbytes, "median_ms": median_ms, "gb_s": nbytes / median_ms / 1e6}


class Loader:
    """Loads cold adapters one after another through reading() (each one a miss: the cold
    names cycle through fewer free slots), recording each load from the manager's counters
    (this thread is the only one loading meanwhile)."""

    def __init__(self, manager: SlotManager, cold: list[str], dev: torch.device) -> None:
        self.manager, self.cold, self.next = manager, cold, 0
        self.stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self.records: list[dict] = []

    def load_one(self) -> dict:
        name = self.cold[self.next % len(self.cold)]
        self.next += 1
        before, start = self.manager.stats(), time.perf_counter()
        # Its own stream: the lease's release event must not wait for queued forwards.
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            with self.manager.reading([name]):
                pass
        wall = time.perf_counter() - start
        after = self.manager.stats()
        origins = {o: n - before.loads.get(o, 0) for o, n in after.loads.items()}
        record = {
            "name": name,
            "origin": ",".join(o for o, n in origins.items() if n) or "hit",
            "wall_ms": 1e3 * wall,
            "load_ms": 1e3 * (sum(after.load_seconds.values()) - sum(before.load_seconds.values())),
            "write_ms": 1e3 * (after.write_seconds - before.write_seconds),
        }
        self.records.append(record)
        return record

    def run_until(self, stop: threading.Event, errors: list) -> None:
        try:
            while not stop.is_set():
                self.load_one()
        except Exception as err:  # reported by the main thread
            errors.append(err)


def forward_stream(layers, manager, x, ids, w, names, n: int, dev) -> dict:
    """n forwards (every MoE layer, under one lease each): per-forward ms, wall seconds."""
    events = []
    sync(dev)
    start = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        if dev.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        with manager.reading(names, device=dev) as (snap, slots):
            for layer, moe in layers.items():
                moe(x, ids, w, slots, snap.banks[layer])
        if dev.type == "cuda":
            end.record()
            events.append((begin, end))
        else:
            events.append(1e3 * (time.perf_counter() - t0))
    sync(dev)
    wall = time.perf_counter() - start
    per = [b.elapsed_time(e) for b, e in events] if dev.type == "cuda" else events
    return {"forwards": n, "wall_s": wall, "median_ms": statistics.median(per), "per_ms": per}


def load_summary(records: list[dict], nbytes: int) -> dict:
    if not records:
        return {"loads": 0}
    write = statistics.median(r["write_ms"] for r in records)
    return {
        "loads": len(records),
        "origins": sorted({r["origin"] for r in records}),
        "median_load_ms": statistics.median(r["load_ms"] for r in records),
        "median_write_ms": write,
        "median_wall_ms": statistics.median(r["wall_ms"] for r in records),
        "write_gb_s": nbytes / write / 1e6 if write > 0 else None,
    }


def checks(manager, layers, model, adapters, x, ids, w, names, dev) -> dict:
    """One forward naming hot and cold adapters (cold ones loaded on demand) against the
    reference; then every slot bit for bit against its adapter in the bank dtype."""
    with manager.reading(names, device=dev) as (snap, slots):
        layer = model.moe_layers[0]
        out = layers[layer](x, ids, w, slots, snap.banks[layer])
        ref = moe_lora_reference(
            x, ids, w, slots, layers[layer].experts, snap.banks[layer], model.shape
        )
    result = compare(out, ref, model.shape.dtype)
    sync(dev)
    snap, exact = manager.snapshot(), 0
    for name, slot in snap.slot_of.items():
        ad = adapters[name]
        exact += all(
            torch.equal(slot_part(getattr(bank, f)[slot], f, ad.rank).cpu(),
                        getattr(ad.layers[layer], f).to(model.shape.dtype))
            for layer, bank in snap.banks.items()
            for f in FACTORS
        )  # fmt: skip
    return {
        "slots_exact": exact,
        "slots": len(snap.slot_of),
        "rel_err": result.rel_err,
        "tol": result.tol,
        "forward_ok": result.ok,
        "ok": exact == len(snap.slot_of) and result.ok,
    }


def slot_part(t: torch.Tensor, factor: str, rank: int) -> torch.Tensor:
    """The [:rank] part of one slot's factor: the rank is the last dim of B, -2 of A."""
    return t[..., :rank] if factor in ("w13_b", "w2_b") else t[..., :rank, :]
