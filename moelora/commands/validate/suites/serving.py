"""`moelora validate --suite serving`: more adapters than slots, at Qwen3-30B-A3B size.

A SlotManager with --serving-slots slots; --serving-hot adapters loaded and pinned (the
forward stream names only them), --serving-cold more registered and loaded on demand by
reading() from the pinned host cache (`max_cpu_loras` = cold, so after one warm-up pass
every cold load comes from host memory over the manager's side stream). Adapters are
random, rank --rank on every expert of every kept MoE layer (the first of --models,
default qwen3-30b-a3b, --serving-layers of its layers, bf16).

Measured in one run (reported, not judged):
  1. host-to-device bandwidth: a pinned buffer the size of one adapter, copied to the GPU
     on a side stream (median of BANDWIDTH_REPS);
  2. per-load time from the host cache with nothing else running, against (1): the slot
     write (zeroing + copies + sync) and the whole load (lookup, claim, write, publish);
  3. the forward stream (every MoE layer per forward, under a reading() lease) alone;
  4. the same forward stream while a second thread loads cold adapters back to back: the
     slowdown of (4) over (3), per forward (CUDA events) and in wall time, and the per-load
     times meanwhile.
Cases (judged): every slot holds its adapter bit for bit; one forward naming hot and cold
adapters matches moe_lora_reference within the dtype's tolerance.

About 1-3 minutes on an H200. On a CPU the same code runs small (the `tiny` preset, fp32,
2 layers, 4 slots, T = 16, 3 forwards; no bandwidth). It drives the slot manager and the
layer directly: the HTTP server's packages (fastapi, pydantic) are not needed.
--serving-json PATH writes every measurement as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ....bench.runner import dump, stamp
from ....config import DeviceFacts, LoRAConfig, ModelConfig, from_hf, parse_dtype
from ....deployment import Deployment
from ....device import probe, target
from ....errors import ConfigError
from ....layer import MoELoRALayer
from ....lora import SlotManager
from ....presets import preset_dict
from ....routing import route
from ....weights import ExpertWeights
from ...flag_types import positive_int
from . import serving_measure as measure
from .adapters import random_adapter
from .serving_report import print_summary
from .suite import CheckSuite, Verdict

BANDWIDTH_REPS = 20


@dataclass(frozen=True)
class Setup:
    """What one run measures: preset cut to `layers`, `slots` slots of which `hot` pinned,
    `cold` more adapters loaded on demand, rank R, T tokens per forward, `forwards` per
    timed stream, `load_rounds` passes over the cold adapters."""

    preset: str
    layers: int
    slots: int
    hot: int
    cold: int
    rank: int
    tokens: int
    forwards: int
    load_rounds: int
    dtype: torch.dtype
    seed: int

    def __post_init__(self) -> None:
        if not 0 < self.hot < self.slots:
            raise ConfigError("--serving-hot", self.hot, f"0 < hot < slots ({self.slots}): "
                              "a free slot for the cold loads", "e.g. --serving-hot 4 "
                              "--serving-slots 8")  # fmt: skip
        if self.cold <= self.slots - self.hot:
            raise ConfigError("--serving-cold", self.cold, f"cold > slots - hot "
                              f"({self.slots - self.hot}), so that every cold load is a miss",
                              f"e.g. --serving-cold {2 * (self.slots - self.hot) + 4}")  # fmt: skip


# (GPU default, CPU default) of each setting the command line leaves out
DEFAULTS = dict(
    preset=("qwen3-30b-a3b", "tiny"), layers=(4, 2), slots=(8, 4), hot=(4, 2), cold=(12, 4),
    tokens=(256, 16), forwards=(200, 3), load_rounds=(3, 1),
)  # fmt: skip


def setup_from(args: argparse.Namespace, device: str) -> Setup:
    """The run's settings: validate's --models (its first), --tokens (the largest), --rank,
    --dtype, --seed and the --serving-* options, each defaulting to DEFAULTS for `device`."""
    pick = 0 if device == "cuda" else 1
    given = dict(
        preset=args.models.split(",")[0] if args.models else None,
        tokens=max(int(t) for t in args.tokens.split(",")) if args.tokens else None,
        **{k: getattr(args, f"serving_{k}") for k in ("layers", "slots", "hot", "cold",
                                                      "forwards", "load_rounds")},
    )  # fmt: skip
    values = {k: DEFAULTS[k][pick] if v is None else v for k, v in given.items()}
    dtype = parse_dtype(args.dtype) if args.dtype else (torch.bfloat16, torch.float32)[pick]
    return Setup(**values, rank=args.rank, dtype=dtype, seed=args.seed)


def model_config(setup: Setup) -> ModelConfig:
    cfg = preset_dict(setup.preset)
    cfg["num_hidden_layers"] = setup.layers
    model = from_hf(cfg, name=f"{setup.preset}-{setup.layers}-layers")
    shape = dataclasses.replace(model.shape, dtype=setup.dtype)
    return dataclasses.replace(model, shape=shape)


def build_layers(setup: Setup, model: ModelConfig, backend: str, dev: torch.device):
    """One MoELoRALayer per kept MoE layer, random experts drawn on the device."""
    shape = model.shape
    facts: DeviceFacts = probe() if dev.type == "cuda" else target("cpu")
    lora = LoRAConfig(enabled=True, max_rank=setup.rank, num_slots=setup.slots)
    deployment = Deployment(shape=shape, routing=model.routing, device=facts, lora=lora,
                            backend=backend, name=model.name)  # fmt: skip
    g = torch.Generator(device=dev).manual_seed(setup.seed)
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    layers = {}
    for layer in model.moe_layers:
        w13 = torch.randn(e, shape.w13_rows, h, generator=g, device=dev) / h**0.5
        w2 = torch.randn(e, h, i, generator=g, device=dev) / i**0.5
        experts = ExpertWeights(w13.to(shape.dtype), w2.to(shape.dtype))
        layers[layer] = MoELoRALayer(deployment, experts, check_values=False)
    return layers


@dataclass
class Bench:
    """Everything one run measures with: the layers, the manager and its adapters, the
    routed tokens [T] and which adapter each names, the cold loader."""

    setup: Setup
    model: ModelConfig
    dev: torch.device
    layers: dict
    manager: SlotManager
    adapters: dict
    routed: tuple  # x [T, H], ids [T, K], w [T, K]
    names: list
    loader: measure.Loader
    nbytes: int  # one adapter in the bank's dtype
    setup_s: float


def prepare(setup: Setup, backend: str, dev: torch.device) -> Bench:
    """Layers, adapters (hot pinned in slots, cold registered), inputs; one warm-up pass
    of every cold adapter into the host cache and 3 forwards (compile, autotune)."""
    t0 = time.perf_counter()
    model = model_config(setup)
    layers = build_layers(setup, model, backend, dev)
    hot = [f"hot{k}" for k in range(setup.hot)]
    cold = [f"cold{k}" for k in range(setup.cold)]
    adapters = {n: random_adapter(model, n, setup.rank, setup.seed + k, dev.type)
                for k, n in enumerate(hot + cold)}  # fmt: skip
    manager = SlotManager(model, setup.slots, setup.rank, device=dev, dtype=setup.dtype,
                          max_cpu_loras=setup.cold)  # fmt: skip
    for name in hot:
        manager.load(adapters[name], name=name, pin=True)
    for name in cold:
        manager.register(name, adapters[name])
    g = torch.Generator().manual_seed(setup.seed)
    x = torch.randn(setup.tokens, model.shape.hidden_size, generator=g).to(dev, setup.dtype)
    logits = torch.randn(setup.tokens, model.shape.num_experts, generator=g)
    ids, w = (t.to(dev) for t in route(logits, model.routing, model.shape.top_k))
    names = [[*hot, None][t % (len(hot) + 1)] for t in range(setup.tokens)]
    loader = measure.Loader(manager, cold, dev)
    for _ in cold:  # warm-up: every cold adapter into the host cache (and once into a slot)
        loader.load_one()
    measure.forward_stream(layers, manager, x, ids, w, names, 3, dev)
    nbytes = sum(getattr(lo, f).numel() for lo in adapters[cold[0]].layers.values()
                 for f in measure.FACTORS) * setup.dtype.itemsize  # fmt: skip
    return Bench(setup, model, dev, layers, manager, adapters, (x, ids, w), names, loader,
                 nbytes, time.perf_counter() - t0)  # fmt: skip


def timed_streams(b: Bench) -> dict:
    """(1) to (4) of the module docstring."""
    x, ids, w = b.routed
    bandwidth = measure.h2d_bandwidth(b.nbytes, BANDWIDTH_REPS, b.dev)
    b.loader.records.clear()
    for _ in range(b.setup.load_rounds * len(b.loader.cold)):
        b.loader.load_one()
    alone_loads = measure.load_summary(b.loader.records, b.nbytes)
    alone = measure.forward_stream(b.layers, b.manager, x, ids, w, b.names, b.setup.forwards, b.dev)
    b.loader.records.clear()
    stop, errors = threading.Event(), []
    thread = threading.Thread(target=b.loader.run_until, args=(stop, errors))
    thread.start()
    busy = measure.forward_stream(b.layers, b.manager, x, ids, w, b.names, b.setup.forwards, b.dev)
    stop.set()
    thread.join(timeout=120)
    if errors:
        raise errors[0]
    return {
        "h2d": bandwidth,
        "loads_alone": alone_loads,
        "loads_beside_forwards": measure.load_summary(b.loader.records, b.nbytes),
        "forwards_alone": {k: v for k, v in alone.items() if k != "per_ms"},
        "forwards_beside_loads": {k: v for k, v in busy.items() if k != "per_ms"},
        "slowdown_median": busy["median_ms"] / alone["median_ms"],
        "slowdown_wall": busy["wall_s"] / alone["wall_s"],
    }


def measure_all(b: Bench) -> dict:
    """The timings, then the checks on a batch of hot and cold adapters and the base model
    (at most one slot each); the record --serving-json writes."""
    timings = timed_streams(b)
    choices = [*dict.fromkeys(b.names), *b.loader.cold[: b.setup.slots - b.setup.hot]]
    mixed = [choices[t % len(choices)] for t in range(len(b.names))]
    check = measure.checks(b.manager, b.layers, b.model, b.adapters, *b.routed, mixed, b.dev)
    shape = b.model.shape
    return {
        **stamp(None),
        "setup": {**dataclasses.asdict(b.setup), "dtype": str(b.setup.dtype)},
        "model": {"name": b.model.name, "E": shape.num_experts, "H": shape.hidden_size,
                  "I": shape.intermediate_size, "K": shape.top_k,
                  "moe_layers": len(b.model.moe_layers), "dtype": str(shape.dtype)},
        "backend": next(iter(b.layers.values())).backend_name,
        "adapter_bytes": b.nbytes,
        "setup_s": b.setup_s,
        **timings,
        "stats": b.manager.stats().as_dict(),
        "checks": check,
    }  # fmt: skip


def run(args: argparse.Namespace, device: str, backend: str) -> Iterator[Verdict]:
    setup = setup_from(args, device)
    result = measure_all(prepare(setup, backend, torch.device(device)))
    print_summary(result)
    if args.serving_json:
        dump(args.serving_json, result)
        print(f"  wrote {args.serving_json}")
    c = result["checks"]
    yield Verdict.of("slots bit-exact", c["slots_exact"] == c["slots"],
                     f"{c['slots_exact']}/{c['slots']} slots hold their adapter bit for bit")  # fmt: skip
    yield Verdict.of("forward vs reference", c["forward_ok"], f"one forward naming hot and "
                     f"cold adapters: rel_err {c['rel_err']:.2e} (tol {c['tol']:.0e})")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "--suite serving", "defaults: GPU / --device cpu; also reads --models (the first), "
        "--tokens (the largest), --rank, --dtype, --seed"
    )  # fmt: skip
    for key, what in (("layers", "MoE layers kept (num_hidden_layers)"),
                      ("slots", "adapter slots L"),
                      ("hot", "pinned adapters the forwards name"),
                      ("cold", "registered adapters loaded on demand"),
                      ("forwards", "forwards per timed stream"),
                      ("load-rounds", "passes over the cold adapters")):  # fmt: skip
        gpu, cpu = DEFAULTS[key.replace("-", "_")]
        group.add_argument(f"--serving-{key}", type=positive_int, default=None, metavar="N",
                           help=f"{what} (default {gpu} / {cpu})")  # fmt: skip
    group.add_argument("--serving-json", default=None, metavar="PATH",
                       help="write every measurement of the run as JSON")  # fmt: skip


SUITE = CheckSuite(
    name="serving",
    summary="a SlotManager serving hot and cold adapters while forwards run: slots bit-exact "
    "and a mixed forward against the reference, with the load and forward timings",
    cpu_refusal=None,
    run=run,
    add_arguments=add_arguments,
    check_args=setup_from,
)
