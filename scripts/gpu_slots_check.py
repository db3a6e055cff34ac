"""GPU check of the slot manager's CUDA half (moelora/lora/slots.py, leases.py): the side
stream its loads write on, and the CUDA event a released lease keeps so that a slot is not
rewritten while the reader's queued kernels may still read it. The CPU tests cover the
locking and the maps; only a GPU has queued work that outlives a `reading()` block.

Checks (the `tiny` preset, one slot, so a second load must reuse the first one's slot):
  1. lease: inside `reading(["a"])` a long kernel (torch.cuda._sleep) is queued, then a copy
     of slot 0's factors; the block exits at once (the copy has not run). `load(b)` must wait
     for the reader's work: the copy sees a's factors, and the bank holds b's afterwards.
  2. control: the same with the release event dropped (leases.SlotLeases.release patched):
     the copy must now see b's factors (or zeros), proving check 1 can fail.
  3. capture (a smoke check): `reading()` inside a CUDA-graph capture runs without error
     (it must not record its event on the capturing stream), leaves no lease, and the
     replay reads the slot. It cannot tell a missing guard from a harmless one unless the
     event record itself fails there.

Run on a GPU machine from the repository root:  python3 scripts/gpu_slots_check.py
Prints one line per check and exits non-zero if any fails.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moelora.lora import Adapter, LayerLoRA, SlotManager, leases
from moelora.presets import resolve_model

RANK = 8
SLEEP_CYCLES = 200_000_000  # ~0.1-0.5 s of one spinning kernel, far above a tiny slot write
MIN_WAIT_S = 0.02  # the load must have waited for it (4acd27b: 104 ms; unwaited 0.4 ms)


def random_adapter(model, name: str, seed: int) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    layers = {}
    for layer in model.moe_layers:
        zeros = LayerLoRA.zeros(model.shape, RANK)
        layers[layer] = LayerLoRA(
            *(torch.randn(t.shape, generator=g) + 0.5 for t in factors(zeros))
        )
    return Adapter(name, "<memory>", RANK, "per_expert", layers, model.shape)


def factors(lora: LayerLoRA) -> tuple[torch.Tensor, ...]:
    return (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b)


def reader_sees(drop_events: bool) -> tuple[str, float]:
    """Which adapter's factors a reader's queued copy saw ('a', 'b', 'zeros', 'other') and
    how long load(b) took, with the release events kept or dropped."""
    model = resolve_model("tiny")
    manager = SlotManager(model, 1, RANK, device="cuda", dtype=torch.float32)
    a, b = random_adapter(model, "a", 1), random_adapter(model, "b", 2)
    manager.load(a)
    layer = model.moe_layers[0]
    bank = manager.snapshot().banks[layer]
    seen = torch.full_like(bank.w13_a[0], float("nan"))  # poisoned until the copy runs
    release = leases.SlotLeases.release
    if drop_events:
        leases.SlotLeases.release = lambda self, slots, event: release(self, slots, None)
    try:
        with manager.reading(["a"]) as (snap, _):
            slot = snap.slots(["a"])[0]
            torch.cuda._sleep(SLEEP_CYCLES)  # the reader's long kernel
            seen.copy_(bank.w13_a[slot])  # queued behind it: runs after the block exits
        start = time.monotonic()
        manager.load(b)
        waited = time.monotonic() - start
    finally:
        leases.SlotLeases.release = release
    torch.cuda.synchronize()
    got = seen.cpu()
    if not torch.equal(bank.w13_a[0].cpu(), b.layers[layer].w13_a):
        return "bank does not hold b after load(b)", waited
    for label, want in (("a", a.layers[layer].w13_a), ("b", b.layers[layer].w13_a)):
        if torch.equal(got, want):
            return label, waited
    return ("zeros" if torch.count_nonzero(got) == 0 else "other"), waited


def capture_releases() -> str:
    """'' when reading() inside a graph capture records no event, releases its lease, and the
    replay reads the slot; else what went wrong."""
    model = resolve_model("tiny")
    manager = SlotManager(model, 1, RANK, device="cuda", dtype=torch.float32)
    a = random_adapter(model, "a", 3)
    manager.load(a)
    bank = manager.snapshot().banks[model.moe_layers[0]]
    out = torch.full_like(bank.w13_a[0], float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with manager.reading(["a"]) as (snap, _):
            out.copy_(bank.w13_a[snap.slots(["a"])[0]])
    if manager._leases.busy():
        return f"lease still held after the capture: {dict(manager._leases.busy())}"
    graph.replay()
    torch.cuda.synchronize()
    if not torch.equal(out.cpu(), a.layers[model.moe_layers[0]].w13_a):
        return "the replay did not read a's factors"
    return ""


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_slots_check: no CUDA device")
        return 2
    print(f"gpu_slots_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    failures = 0
    seen, waited = reader_sees(drop_events=False)
    # the wait too: a load slow for another reason would also let the copy see 'a'
    ok = seen == "a" and waited > MIN_WAIT_S
    failures += not ok
    print(
        f"{'PASS' if ok else 'FAIL'}  lease: the reader's queued copy saw {seen!r} (want 'a'); "
        f"load(b) waited {waited * 1e3:.1f} ms for the reader's kernels (want > "
        f"{MIN_WAIT_S * 1e3:.0f})"
    )
    seen, waited = reader_sees(drop_events=True)
    ok = seen in ("b", "zeros")
    failures += not ok
    print(
        f"{'PASS' if ok else 'FAIL'}  control: without the release event the copy saw {seen!r} "
        f"(want 'b' or 'zeros': the race check 1 guards against); load(b) took "
        f"{waited * 1e3:.1f} ms"
    )
    problem = capture_releases()
    failures += bool(problem)
    print(
        f"{'PASS' if not problem else 'FAIL'}  capture: "
        + (problem or "no event in the capture, lease released, the replay read the slot")
    )
    print(f"gpu_slots_check: {3 - failures}/3 passed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
