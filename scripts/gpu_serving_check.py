"""GPU serving check (issue 17): more adapters than slots, at Qwen3-30B-A3B size.

A SlotManager with `--slots` slots; `--hot` adapters loaded and pinned (the forward stream
names only them), `--cold` more registered and loaded on demand by reading() from the
pinned host cache (`max_cpu_loras` = --cold, so after one warm-up pass every cold load
comes from host memory over the manager's side stream). Adapters are random, rank R on
every expert of every kept MoE layer (preset `qwen3-30b-a3b`, `--layers` of them, bf16).

Measured in one run:
  1. host-to-device bandwidth: a pinned buffer the size of one adapter, copied to the GPU
     on a side stream (median of --bandwidth-reps);
  2. per-load time from the host cache with nothing else running, against (1): the slot
     write (zeroing + copies + sync) and the whole load (lookup, claim, write, publish);
  3. the forward stream (every MoE layer per forward, under a reading() lease) alone;
  4. the same forward stream while a second thread loads cold adapters back to back: the
     slowdown of (4) over (3), per forward (CUDA events) and in wall time, and the per-load
     times meanwhile.
  5. checks: every slot holds its adapter bit for bit; one forward naming hot and cold
     adapters matches moe_lora_reference within the dtype's tolerance.

Run from the repository root on a CUDA machine (about 1-3 minutes on an H200):
    python scripts/gpu_serving_check.py
Prints a summary and writes gpu_serving_check.json to $OUT (or ./out). Exit status 1 if a
check of (5) fails; the timings are reported, not judged. `--device cpu --preset tiny
--moe-backend reference` runs the same code on a CPU (what tests/test_gpu_scripts.py does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moelora import (  # noqa: E402
    Deployment,
    ExpertWeights,
    LoRAConfig,
    MoELoRALayer,
    from_hf,
    moe_lora_reference,
    route,
)
from moelora.compare import compare  # noqa: E402
from moelora.device import probe, target  # noqa: E402
from moelora.lora import Adapter, LayerLoRA, SlotManager  # noqa: E402
from moelora.presets import preset_dict  # noqa: E402

FACTORS = ("w13_a", "w13_b", "w2_a", "w2_b")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b", help="a qwen3_moe-style preset")
    p.add_argument("--layers", type=int, default=4, help="MoE layers kept (num_hidden_layers)")
    p.add_argument("--slots", type=int, default=8, help="adapter slots L")
    p.add_argument("--hot", type=int, default=4, help="pinned adapters the forwards name")
    p.add_argument("--cold", type=int, default=12, help="registered adapters loaded on demand")
    p.add_argument("--rank", type=int, default=16, help="adapter rank = max rank R")
    p.add_argument("--tokens", type=int, default=256, help="tokens per forward T")
    p.add_argument("--forwards", type=int, default=200, help="forwards per timed stream")
    p.add_argument("--load-rounds", type=int, default=3, help="passes over the cold adapters")
    p.add_argument("--bandwidth-reps", type=int, default=20)
    p.add_argument("--moe-backend", default="auto", help="auto or a backend name")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT") or "out", help="folder for the JSON")
    return p.parse_args(argv)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def model_config(args: argparse.Namespace, dtype: torch.dtype):
    cfg = preset_dict(args.preset)
    cfg["num_hidden_layers"] = args.layers
    model = from_hf(cfg, name=f"{args.preset}-{args.layers}-layers")
    return dataclasses.replace(model, shape=dataclasses.replace(model.shape, dtype=dtype))


def random_adapter(model, name: str, rank: int, dev: torch.device, seed: int) -> Adapter:
    """An Adapter as load_adapter returns it (fp32, on the CPU), drawn on `dev` for speed:
    w13_a [E, S, r, H], w13_b [E, S, I, r], w2_a [E, r, I], w2_b [E, H, r]."""
    sh = model.shape
    e, s, h, i = sh.num_experts, sh.activation.width_factor, sh.hidden_size, sh.intermediate_size
    shapes = ((e, s, rank, h), (e, s, i, rank), (e, rank, i), (e, h, rank))
    fans = (h, rank, i, rank)  # keeps the delta comparable to the base output
    g = torch.Generator(device=dev).manual_seed(seed)
    layers = {
        layer: LayerLoRA(
            *(
                (torch.randn(dims, generator=g, device=dev) / fan**0.5).cpu()
                for dims, fan in zip(shapes, fans)
            )
        )
        for layer in model.moe_layers
    }
    return Adapter(name, "<memory>", rank, "per_expert", layers, model.shape)


def build_layers(args, model, dev: torch.device) -> dict[int, MoELoRALayer]:
    """One MoELoRALayer per kept MoE layer, random experts drawn on the device."""
    shape = model.shape
    deployment = Deployment(
        shape=shape,
        routing=model.routing,
        device=probe() if dev.type == "cuda" else target("cpu"),
        lora=LoRAConfig(enabled=True, max_rank=args.rank, num_slots=args.slots),
        backend=args.moe_backend,
        name=model.name,
    )
    g = torch.Generator(device=dev).manual_seed(args.seed)
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    layers = {}
    for layer in model.moe_layers:
        w13 = torch.randn(e, shape.w13_rows, h, generator=g, device=dev) / h**0.5
        w2 = torch.randn(e, h, i, generator=g, device=dev) / i**0.5
        experts = ExpertWeights(w13.to(shape.dtype), w2.to(shape.dtype))
        layers[layer] = MoELoRALayer(deployment, experts, check_values=False)
    return layers


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
        "ok": exact == len(snap.slot_of) and result.ok,
    }


def slot_part(t: torch.Tensor, factor: str, rank: int) -> torch.Tensor:
    """The [:rank] part of one slot's factor: the rank is the last dim of B, -2 of A."""
    return t[..., :rank] if factor in ("w13_b", "w2_b") else t[..., :rank, :]


def commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not 0 < args.hot < args.slots or args.cold <= args.slots - args.hot:
        raise SystemExit(
            f"--hot {args.hot}, --slots {args.slots}, --cold {args.cold}: need 0 < hot < slots "
            "and cold > slots - hot (so that every cold load is a miss)"
        )
    want = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    if want in ("auto", "cpu"):
        want = "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu for a dry run)")
    dev = torch.device(want)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = model_config(args, dtype)
    t0 = time.perf_counter()
    layers = build_layers(args, model, dev)
    hot = [f"hot{k}" for k in range(args.hot)]
    cold = [f"cold{k}" for k in range(args.cold)]
    adapters = {n: random_adapter(model, n, args.rank, dev, args.seed + k)
                for k, n in enumerate(hot + cold)}  # fmt: skip
    manager = SlotManager(model, args.slots, args.rank, device=dev, dtype=dtype,
                          max_cpu_loras=args.cold)  # fmt: skip
    for name in hot:
        manager.load(adapters[name], name=name, pin=True)
    for name in cold:
        manager.register(name, adapters[name])
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.tokens, model.shape.hidden_size, generator=g).to(dev, dtype)
    logits = torch.randn(args.tokens, model.shape.num_experts, generator=g)
    ids, w = (t.to(dev) for t in route(logits, model.routing, model.shape.top_k))
    names = [[*hot, None][t % (len(hot) + 1)] for t in range(args.tokens)]
    loader = Loader(manager, cold, dev)
    for _ in cold:  # warm-up: every cold adapter into the host cache (and once into a slot)
        loader.load_one()
    forward_stream(layers, manager, x, ids, w, names, 3, dev)  # compile, autotune
    setup_s = time.perf_counter() - t0
    nbytes = sum(getattr(lo, f).numel() for lo in adapters[cold[0]].layers.values()
                 for f in FACTORS) * dtype.itemsize  # fmt: skip
    return report(args, model, dev, manager, layers, adapters, loader, x, ids, w, names,
                  nbytes, setup_s)  # fmt: skip


def report(args, model, dev, manager, layers, adapters, loader, x, ids, w, names, nbytes,
           setup_s) -> int:  # fmt: skip
    bandwidth = h2d_bandwidth(nbytes, args.bandwidth_reps, dev)
    loader.records.clear()
    for _ in range(args.load_rounds * len(loader.cold)):
        loader.load_one()
    alone_loads = load_summary(loader.records, nbytes)
    alone = forward_stream(layers, manager, x, ids, w, names, args.forwards, dev)
    loader.records.clear()
    stop, errors = threading.Event(), []
    thread = threading.Thread(target=loader.run_until, args=(stop, errors))
    thread.start()
    busy = forward_stream(layers, manager, x, ids, w, names, args.forwards, dev)
    stop.set()
    thread.join(timeout=120)
    if errors:
        raise errors[0]
    busy_loads = load_summary(loader.records, nbytes)
    # hot and cold adapters and the base model in one batch, at most one slot each
    choices = [*dict.fromkeys(names), *loader.cold[: args.slots - args.hot]]
    mixed = [choices[t % len(choices)] for t in range(len(names))]
    check = checks(manager, layers, model, adapters, x, ids, w, mixed, dev)
    result = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "commit": commit(),
        "args": vars(args),
        "model": {"name": model.name, "E": model.shape.num_experts, "H": model.shape.hidden_size,
                  "I": model.shape.intermediate_size, "K": model.shape.top_k,
                  "moe_layers": len(model.moe_layers), "dtype": str(model.shape.dtype)},
        "backend": next(iter(layers.values())).backend_name,
        "adapter_bytes": nbytes,
        "setup_s": setup_s,
        "h2d": bandwidth,
        "loads_alone": alone_loads,
        "loads_beside_forwards": busy_loads,
        "forwards_alone": {k: v for k, v in alone.items() if k != "per_ms"},
        "forwards_beside_loads": {k: v for k, v in busy.items() if k != "per_ms"},
        "slowdown_median": busy["median_ms"] / alone["median_ms"],
        "slowdown_wall": busy["wall_s"] / alone["wall_s"],
        "stats": manager.stats().as_dict(),
        "checks": check,
    }  # fmt: skip
    print_summary(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_serving_check.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {out / 'gpu_serving_check.json'}")
    return 0 if check["ok"] else 1


def _ms(v) -> str:
    return "n/a" if v is None else f"{v:.3f} ms"


def print_summary(r: dict) -> None:
    m, a = r["model"], r["args"]
    print(f"gpu_serving_check on {r['device']} (torch {r['torch']}, commit {r['commit']}): "
          f"{m['name']} E={m['E']} H={m['H']} I={m['I']} {m['moe_layers']} MoE layers "
          f"{m['dtype']}, R={a['rank']}, {a['slots']} slots ({a['hot']} pinned hot), "
          f"{a['cold']} cold via the host cache, T={a['tokens']}, backend {r['backend']}")  # fmt: skip
    h2d = r["h2d"]
    gbs = "n/a" if h2d["gb_s"] is None else f"{h2d['gb_s']:.1f} GB/s"
    print(f"  adapter {r['adapter_bytes'] / 1e6:.1f} MB; H2D pinned copy {gbs} "
          f"({_ms(h2d['median_ms'])}); setup {r['setup_s']:.1f} s")  # fmt: skip
    for key, label in (("loads_alone", "loads alone"), ("loads_beside_forwards", "loads + fwds")):
        s = r[key]
        if not s["loads"]:
            print(f"  {label:<14} none")
            continue
        eff = ""
        if s["write_gb_s"] and h2d["gb_s"]:
            eff = (
                f" = {s['write_gb_s']:.1f} GB/s, {100 * s['write_gb_s'] / h2d['gb_s']:.0f}% of H2D"
            )
        print(f"  {label:<14} n={s['loads']} from {s['origins']}: median load "
              f"{_ms(s['median_load_ms'])}, slot write {_ms(s['median_write_ms'])}{eff}")  # fmt: skip
    fa, fb = r["forwards_alone"], r["forwards_beside_loads"]
    print(f"  forwards alone  {fa['forwards']}: median {_ms(fa['median_ms'])}, wall "
          f"{fa['wall_s']:.3f} s")  # fmt: skip
    print(f"  forwards+loads  {fb['forwards']}: median {_ms(fb['median_ms'])} "
          f"(x{r['slowdown_median']:.3f}), wall {fb['wall_s']:.3f} s (x{r['slowdown_wall']:.3f})")  # fmt: skip
    c = r["checks"]
    print(f"  checks: slots bit-exact {c['slots_exact']}/{c['slots']}, forward vs reference "
          f"rel_err {c['rel_err']:.2e} (tol {c['tol']:.0e}): {'PASS' if c['ok'] else 'FAIL'}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
