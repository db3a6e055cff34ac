"""`moelora validate --suite slots`: the slot manager's CUDA half (moelora/lora/slots.py,
leases.py): the side stream its loads write on, and the CUDA event a released lease keeps so
that a slot is not rewritten while the reader's queued kernels may still read it. The CPU
tests cover the locking and the maps; only a GPU has queued work that outlives a
`reading()` block, so this suite needs one.

Cases (the `tiny` preset, one slot, so a second load must reuse the first one's slot):
  lease: inside `reading(["a"])` a long kernel (torch.cuda._sleep) is queued, then a copy
    of slot 0's factors; the block exits at once (the copy has not run). `load(b)` must wait
    for the reader's work: the copy sees a's factors, and the bank holds b's afterwards.
  control: the same with the release event dropped (leases.SlotLeases.release patched):
    the copy must now see b's factors (or zeros), proving the lease case can fail.
  capture (a smoke check): `reading()` inside a CUDA-graph capture runs without error (it
    must not record its event on the capturing stream), leaves no lease, and the replay
    reads the slot. It cannot tell a missing guard from a harmless one unless the event
    record itself fails there.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import torch

from .... import cuda_graphs
from ....lora import SlotManager, leases
from ....presets import resolve_model
from .adapters import random_adapter
from .suite import CheckSuite, Verdict

RANK = 8
SLEEP_CYCLES = 200_000_000  # ~0.1-0.5 s of one spinning kernel, far above a tiny slot write
MIN_WAIT_S = 0.02  # the load must have waited for it (H200 at 4acd27b: 104 ms; unwaited 0.4 ms)


def adapter(model, name: str, seed: int):
    """Factors shifted off zero by 0.5: an empty slot (zeros) is told apart from them."""
    return random_adapter(model, name, RANK, seed, offset=0.5)


def reader_sees(drop_events: bool) -> tuple[str, float]:
    """Which adapter's factors a reader's queued copy saw ('a', 'b', 'zeros', 'other') and
    how long load(b) took, with the release events kept or dropped."""
    model = resolve_model("tiny")
    manager = SlotManager(model, 1, RANK, device="cuda", dtype=torch.float32)
    a, b = adapter(model, "a", 1), adapter(model, "b", 2)
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


def capture_problem() -> str:
    """'' when reading() inside a graph capture records no event, releases its lease, and the
    replay reads the slot; else what went wrong."""
    model = resolve_model("tiny")
    manager = SlotManager(model, 1, RANK, device="cuda", dtype=torch.float32)
    a = adapter(model, "a", 3)
    manager.load(a)
    bank = manager.snapshot().banks[model.moe_layers[0]]
    out = torch.full_like(bank.w13_a[0], float("nan"))

    def step() -> None:
        with manager.reading(["a"]) as (snap, _):
            out.copy_(bank.w13_a[snap.slots(["a"])[0]])

    graph = cuda_graphs.capture(step, warmups=0)  # the reading itself is what is captured
    if manager.leased():
        return f"lease still held after the capture: {manager.leased()}"
    graph.replay()
    torch.cuda.synchronize()
    if not torch.equal(out.cpu(), a.layers[model.moe_layers[0]].w13_a):
        return "the replay did not read a's factors"
    return ""


def lease_verdict(seen: str, waited: float) -> Verdict:
    # the wait too: a load slow for another reason would also let the copy see 'a'
    return Verdict.of(
        "lease",
        seen == "a" and waited > MIN_WAIT_S,
        f"the reader's queued copy saw {seen!r} (want 'a'); load(b) waited "
        f"{waited * 1e3:.1f} ms for the reader's kernels (want > {MIN_WAIT_S * 1e3:.0f})",
    )


def control_verdict(seen: str, waited: float) -> Verdict:
    return Verdict.of(
        "control",
        seen in ("b", "zeros"),
        f"without the release event the copy saw {seen!r} (want 'b' or 'zeros': the race "
        f"the lease case guards against); load(b) took {waited * 1e3:.1f} ms",
    )


def capture_verdict(problem: str) -> Verdict:
    detail = problem or "no event in the capture, lease released, the replay read the slot"
    return Verdict.of("capture", not problem, detail)


def run(args: argparse.Namespace, device: str, backend: str) -> Iterator[Verdict]:
    yield lease_verdict(*reader_sees(drop_events=False))
    yield control_verdict(*reader_sees(drop_events=True))
    yield capture_verdict(capture_problem())


SUITE = CheckSuite(
    name="slots",
    summary="the slot manager's load stream and released-lease events under queued GPU "
    "work, and reading() inside a CUDA-graph capture (GPU only)",
    cpu_refusal="it checks GPU work queued behind a released lease and a CUDA-graph capture: "
    "a CPU has neither",
    run=run,
    uses_backend=False,
)
