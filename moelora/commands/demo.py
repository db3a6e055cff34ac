"""`moelora demo`: end to end on an embedded preset, with random weights and adapters.

Adapters are written as PEFT directories and loaded through the real path (load_adapter +
SlotManager, read under a lease); the oracle picks the backend for this machine (one log line says why); a
batch whose requests use different adapters (and the base model) runs through the layer;
the summary compares it with the reference, adapter by adapter.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from pathlib import Path

import torch

from ..compare import compare
from ..config import LoRAConfig
from ..deployment import Deployment
from ..device import probe
from ..layer import MoELoRALayer, to_device
from ..lora import LayerLoRA, SlotManager
from ..lora.export import save_adapter
from ..presets import resolve_model
from ..reference import moe_lora_reference
from ..routing import route
from ..weights import random_expert_weights, random_lora_bank


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="end-to-end demo on a small preset (CPU when no GPU)")
    p.add_argument("--model", default="tiny", help="preset name or config.json (default: tiny)")
    p.add_argument("--tokens", type=_positive, default=48, help="tokens in the batch (default 48)")
    p.add_argument("--adapters", type=_positive, default=4, help="adapters in slots (default 4)")
    p.add_argument("--rank", type=_positive, default=8, help="max LoRA rank R (default 8)")
    p.add_argument("--moe-backend", default="auto", help="auto or a backend name")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: fresh)")
    p.add_argument(
        "--no-interpret",
        action="store_true",
        help="without a GPU, do not run Triton kernels through TRITON_INTERPRET=1",
    )
    p.set_defaults(run=run)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: expected a positive integer")
    return value


def _write_adapters(model, count: int, rank: int, root: Path, gen) -> list[Path]:
    """`count` random PEFT adapters covering every MoE layer; ranks R, R/2, R/4, ..."""
    ranks = [max(1, rank >> (a % 3)) for a in range(count)]
    paths = []
    for a, r in enumerate(ranks):
        layers = {}
        for n in model.moe_layers:
            bank = random_lora_bank(model.shape, 1, r, generator=gen, dtype=torch.float32)
            layers[n] = LayerLoRA(bank.w13_a[0], bank.w13_b[0], bank.w2_a[0], bank.w2_b[0])
        path = root / f"adapter-{a}"
        save_adapter(path, model, layers, r, alpha=2.0 * r)
        paths.append(path)
    return paths


def _requests(tokens: int, names: list[str], gen: torch.Generator) -> list[str | None]:
    """One adapter name (or None: the base model) per token; every choice present."""
    choices: list[str | None] = [None, *names]
    picks = torch.randint(0, len(choices), (tokens,), generator=gen).tolist()
    picks[: len(choices)] = range(len(choices))[:tokens]
    return [choices[i] for i in picks]


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available() and not args.no_interpret:
        # No GPU: run the fused Triton kernels through Triton's interpreter (slow, exact),
        # so the demo exercises the same kernels a GPU runs. Set before any kernel import.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    model = resolve_model(args.model)
    device = probe()
    torch_device = "cuda" if device.kind == "cuda" else "cpu"
    dtype = torch.bfloat16 if device.kind == "cuda" else torch.float32
    shape = dataclasses.replace(model.shape, dtype=dtype)
    seed = args.seed if args.seed is not None else int(time.time_ns() % 2**31)
    gen = torch.Generator().manual_seed(seed)

    lora_cfg = LoRAConfig(enabled=True, max_rank=args.rank, max_loras=args.adapters)
    deployment = Deployment(
        shape=shape,
        routing=model.routing,
        device=device,
        lora=lora_cfg,
        backend=args.moe_backend,
        name=model.name,
    )
    experts = random_expert_weights(shape, generator=gen, dtype=torch.float32)
    layer = MoELoRALayer(deployment, to_device(experts, torch_device, dtype))

    manager = SlotManager(model, args.adapters, args.rank, device=torch_device, dtype=dtype)
    with tempfile.TemporaryDirectory() as tmp:
        for path in _write_adapters(model, args.adapters, args.rank, Path(tmp), gen):
            manager.load(path, name=path.name)
    names = _requests(args.tokens, list(manager.loaded), gen)

    x = torch.randn(args.tokens, shape.hidden_size, generator=gen).to(torch_device, dtype)
    ids, weights = route(
        torch.randn(args.tokens, shape.num_experts, generator=gen), model.routing, shape.top_k
    )
    ids, weights = ids.to(torch_device), weights.to(torch_device)
    on_input = model.routing.method.weights_on_input
    # The lease is how a server reads the slots: no load may rewrite them until it ends.
    with manager.reading(names, device=torch_device) as (snapshot, slots):
        bank = snapshot.banks[model.moe_layers[0]]
        start = time.perf_counter()
        y = layer(x, ids, weights, slots, bank)
        if device.kind == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        ref = moe_lora_reference(
            x, ids, weights, slots, layer.experts, bank, shape, weights_on_input=on_input
        )
    base = moe_lora_reference(
        x, ids, weights, None, layer.experts, None, shape, weights_on_input=on_input
    )
    return _summary(model, shape, deployment, layer, names, slots, y, ref, base, elapsed, seed)


def _summary(model, shape, deployment, layer, names, slots, y, ref, base, elapsed, seed) -> int:
    print(f"\nmoelora demo: model {model.name} ({model.model_type}), seed {seed}")
    print(
        f"  E={shape.num_experts} K={shape.top_k} H={shape.hidden_size} "
        f"I={shape.intermediate_size} activation={shape.activation.value} "
        f"routing={model.routing.method.value} dtype={str(shape.dtype).split('.')[-1]}"
    )
    interpreted = (
        deployment.device.interpreted and layer.selection.backend.capabilities.cpu_needs_interpreter
    )
    where = " (Triton interpreter)" if interpreted else ""
    print(
        f"  device {deployment.device.name}{where}: backend {layer.backend_name} "
        f"({layer.selection.how}); forward {elapsed * 1e3:.1f} ms"
    )
    print("  adapter     slot  tokens  change vs base  error vs reference")
    ok = True
    for name in dict.fromkeys(names):
        rows = torch.tensor([n == name for n in names], device=y.device)
        change = compare(y[rows], base[rows], tol=float("inf")).rel_err
        err = compare(y[rows], ref[rows], shape.dtype)
        ok = ok and err.ok
        slot = int(slots[rows][0])
        print(f"  {name or 'base':<10} {slot:>5}  {int(rows.sum()):>6}  {change:>14.3e}  {err}")
    # Within tolerance, not bit-identical: a backend may tile a LoRA batch differently from
    # a LoRA-free one, which changes the fp32 summation order.
    base_err = compare(y[slots < 0], base[slots < 0], shape.dtype)
    exact = "bit-identical" if torch.equal(y[slots < 0], base[slots < 0]) else str(base_err)
    print(f"  base-model rows vs the backend's LoRA-free run: {exact}")
    ok = ok and base_err.ok
    print(f"  verdict: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1
