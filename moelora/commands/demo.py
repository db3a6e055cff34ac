"""`moelora demo`: end to end on an embedded preset, with random weights and adapters.

Adapters are written as PEFT directories and loaded through the real path (load_adapter +
SlotManager, read under a lease); the oracle picks the backend for this machine (one log
line says why, and the summary shows a fallback); a batch whose requests use different
adapters (and the base model) runs through the layer; the summary compares it, adapter by
adapter, with an independent implementation: the reference, or, when the selected backend
is the reference itself, another backend that accepts the deployment. When none does, the
summary says that no independent check ran (verdict UNCHECKED) instead of a PASS of the
reference against itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..compare import compare
from ..config import LoRAConfig
from ..deployment import AUTO, Deployment
from ..device import probe
from ..errors import EXIT_FAILED, EXIT_OK, UnsupportedDeploymentError
from ..layer import MoELoRALayer, to_device
from ..lora import LayerLoRA, SlotManager
from ..lora.export import save_adapter
from ..nearest import nearest
from ..oracle import default_registry, evaluate
from ..oracle import ranking as oracle_ranking
from ..presets import PRESETS, resolve_model
from ..reference import moe_lora_reference
from ..routing import route
from ..weights import random_expert_weights, random_lora_bank
from .cpu_cost import demo_cost
from .flag_terms import run_on
from .flag_types import positive_int

REFERENCE = "reference"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="end-to-end demo on a small preset (CPU when no GPU)",
        description="Random expert weights and PEFT adapters, loaded into slots; one batch of "
        "mixed adapters through the backend the oracle picks, compared with an independent "
        "implementation. Exit codes: 0 pass (or UNCHECKED, said so), 1 a mismatch, 2 bad "
        "usage, 3 the requested backend is refused here.",
    )
    p.add_argument(
        "--model",
        default="tiny",
        help=f"a preset ({', '.join(PRESETS)}), a config.json path or a model directory "
        "(default: tiny, seconds on a CPU; the others take minutes and GBs there: the demo "
        "warns first)",
    )
    p.add_argument(
        "--tokens", type=positive_int, default=48, help="tokens in the batch (default 48)"
    )
    p.add_argument("--adapters", type=positive_int, default=4, help="adapters in slots (default 4)")
    p.add_argument("--rank", type=positive_int, default=8, help="max LoRA rank R (default 8)")
    p.add_argument(
        "--moe-backend",
        default=AUTO,
        help=f"auto (the fastest that accepts) or one of {', '.join(default_registry())}",
    )
    p.add_argument("--seed", type=int, default=None, help="random seed (default: fresh)")
    p.add_argument(
        "--no-interpret",
        action="store_true",
        help="without a GPU, do not run Triton kernels through TRITON_INTERPRET=1 (the "
        "reference then runs, and nothing independent checks it)",
    )
    p.set_defaults(run=run)


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


def _warn_cost(args: argparse.Namespace, model, deployment: Deployment) -> None:
    """On a CPU, before anything is built: the estimate, when it is more than seconds."""
    if deployment.device.kind != "cpu":
        return
    verdicts = evaluate(deployment)
    chosen = args.moe_backend
    if chosen == AUTO:
        chosen = next((n for n, reasons in verdicts.items() if not reasons), None)
    capabilities = default_registry()[chosen].capabilities if chosen in verdicts else None
    interpreted = bool(capabilities and capabilities.cpu_needs_interpreter)
    cost = demo_cost(model, args.tokens, args.adapters, args.rank, interpreted)
    if cost.large:
        where = "the Triton interpreter" if interpreted else "the reference"
        print(
            f"moelora demo: warning: --model {args.model} on this CPU ({where}) takes "
            f"{cost.describe()} (estimate, moelora/commands/cpu_cost.py). Fix: --model tiny "
            "runs in seconds; run on a GPU for the real sizes",
            file=sys.stderr,
            flush=True,
        )


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

    lora_cfg = LoRAConfig(enabled=True, max_rank=args.rank, num_slots=args.adapters)
    deployment = Deployment(
        shape=shape,
        routing=model.routing,
        device=device,
        lora=lora_cfg,
        backend=args.moe_backend,
        name=model.name,
    )
    _warn_cost(args, model, deployment)
    experts = random_expert_weights(shape, generator=gen, dtype=torch.float32)
    layer = _layer(args, deployment, to_device(experts, torch_device, dtype))  # may refuse
    checker = _checker(layer, deployment)

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
        check = _check_outputs(checker, layer, x, ids, weights, slots, bank, on_input)
    base = moe_lora_reference(
        x, ids, weights, None, layer.experts, None, shape, weights_on_input=on_input
    )
    run_ = dict(y=y, base=base, slots=slots, names=names, elapsed=elapsed, seed=seed)
    return _summary(args, model, shape, deployment, layer, checker, check, run_)


def _checker(layer: MoELoRALayer, deployment: Deployment) -> MoELoRALayer | str | None:
    """What checks the selected backend: the reference (by name), or, when the backend is
    the reference, a layer on the first other backend that accepts the deployment; None
    when nothing independent accepts it here."""
    if layer.backend_name != REFERENCE:
        return REFERENCE
    other = next((name for name, reasons in layer.selection.others if not reasons), None)
    if other is None:
        return None
    return MoELoRALayer(dataclasses.replace(deployment, backend=other), layer.experts)


def _check_outputs(checker, layer, x, ids, weights, slots, bank, on_input):
    """(with LoRA, LoRA-free) outputs of the checker, or None."""
    if checker is None:
        return None
    if checker == REFERENCE:
        args = (layer.experts, bank, layer.shape)
        ref = moe_lora_reference(x, ids, weights, slots, *args, weights_on_input=on_input)
        args = (layer.experts, None, layer.shape)
        free = moe_lora_reference(x, ids, weights, None, *args, weights_on_input=on_input)
        return ref, free
    return checker(x, ids, weights, slots, bank), checker(x, ids, weights)


def _backend_line(deployment: Deployment, layer: MoELoRALayer, elapsed: float) -> str:
    selection = layer.selection
    where = " (Triton interpreter)" if selection.interpreted else ""
    how = f"explicit: --moe-backend {selection.name}"
    if selection.how == AUTO:
        how = "auto: the fastest backend that runs here"
    ranking = list(oracle_ranking(deployment, default_registry()))
    faster = [  # ranked above the selected one, and refused: auto fell back past them
        f"{n} ({'; '.join(map(str, r))})"
        for n, r in selection.others
        if r and n in ranking and ranking.index(n) < ranking.index(selection.name)
    ]
    if selection.how == AUTO and faster:
        how = f"auto fallback, refused: {', '.join(faster)}"
    slower = [n for n, r in selection.others if not r and n in selection.interpreted_here]
    if selection.how == AUTO and slower:
        how += f"; {slower[0]} would run interpreted on this cpu (slower)"
    return (
        f"  device {deployment.device.name}{where}: backend {layer.backend_name} ({how}); "
        f"forward {elapsed * 1e3:.1f} ms"
    )


def _summary(args, model, shape, deployment, layer, checker, check, run_) -> int:
    y, base, slots, names = run_["y"], run_["base"], run_["slots"], run_["names"]
    checker_name = checker if isinstance(checker, str) or checker is None else checker.backend_name
    print(f"\nmoelora demo: model {model.name} ({model.model_type}), seed {run_['seed']}")
    print(
        f"  E={shape.num_experts} K={shape.top_k} H={shape.hidden_size} "
        f"I={shape.intermediate_size} activation={shape.activation.value} "
        f"routing={model.routing.method.value} dtype={str(shape.dtype).split('.')[-1]}"
    )
    print(_backend_line(deployment, layer, run_["elapsed"]))
    print(f"  checked against: {_checked_against(checker_name)}")
    column = f"error vs {checker_name}" if checker_name else "independent check"
    print(f"  adapter     slot  tokens  change vs base  {column}")
    ok = True
    for name in dict.fromkeys(names):
        rows = torch.tensor([n == name for n in names], device=y.device)
        change = compare(y[rows], base[rows], tol=float("inf")).rel_err
        cell = "not run"
        if check is not None:
            err = compare(y[rows], check[0][rows], shape.dtype)
            ok, cell = ok and err.ok, str(err)
        slot = int(slots[rows][0])
        print(f"  {name or 'base':<10} {slot:>5}  {int(rows.sum()):>6}  {change:>14.3e}  {cell}")
    if check is None:
        print("  base-model rows (slot -1) vs a LoRA-free run: not checked (same reference)")
        print(f"  verdict: UNCHECKED: {_unchecked_fix(args, layer)}")
        return EXIT_OK
    # Within tolerance, not bit-identical: a backend may tile a LoRA batch differently from
    # a LoRA-free one, which changes the fp32 summation order.
    free = check[1]
    base_err = compare(y[slots < 0], free[slots < 0], shape.dtype)
    exact = "bit-identical" if torch.equal(y[slots < 0], free[slots < 0]) else str(base_err)
    whose = "the reference's" if checker_name == REFERENCE else f"{checker_name}'s"
    print(f"  base-model rows (slot -1) vs {whose} LoRA-free run: {exact}")
    ok = ok and base_err.ok
    print(f"  verdict: {'PASS' if ok else 'FAIL'} ({layer.backend_name} vs {checker_name})")
    return EXIT_OK if ok else EXIT_FAILED


def _checked_against(checker_name: str | None) -> str:
    if checker_name == REFERENCE:
        return "the reference (moelora.reference: fp32 loops), an independent implementation"
    if checker_name:
        return (
            f"{checker_name}, an independent implementation (the selected backend is the "
            "reference itself)"
        )
    return (
        "nothing independent: the selected backend is the reference itself, and no other "
        "backend accepts this deployment here"
    )


# How the plan's flags read as the demo's (moelora.nearest speaks the plan's).
_DEMO_FLAGS = (("--max-lora-rank", "--rank"), ("--max-loras", "--adapters"))


def demo_speak(changes: tuple[str, ...], no_interpret: bool) -> str:
    """A nearest deployment's changes as the demo's flags. The demo has no --device: on a
    GPU it runs bf16 and eager by itself, so a device change reads as 'run on a GPU'."""
    device = next((c.split()[1] for c in changes if c.startswith("--device")), None)
    if device is not None:
        return run_on(device)
    text = " ".join(changes)
    for plan_flag, demo_flag in _DEMO_FLAGS:
        text = text.replace(plan_flag, demo_flag)
    if no_interpret:
        text = text.replace("export TRITON_INTERPRET=1", "drop --no-interpret")
    return text


def _unchecked_fix(args: argparse.Namespace, layer: MoELoRALayer) -> str:
    others = [name for name, _ in layer.selection.others]
    found = nearest(layer.deployment, default_registry(), others)
    fixes = [f"{demo_speak(c, args.no_interpret)} ({name} then checks it)" for name, c in found]
    fix = "; or ".join(fixes) or "run on a GPU"
    return f"the reference ran and no independent check ran. Fix: {fix}"


def _layer(args: argparse.Namespace, deployment: Deployment, experts) -> MoELoRALayer:
    """The layer, or the oracle's refusal with its fixes in the demo's flags."""
    try:
        return MoELoRALayer(deployment, experts)
    except UnsupportedDeploymentError as err:
        speak = [(n, (demo_speak(c, args.no_interpret),)) for n, c in err.nearest]
        raise UnsupportedDeploymentError(err.requested, err.reasons, err.accepting, speak) from None
