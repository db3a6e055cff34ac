"""`moelora plan`: check a deployment against every backend, without a GPU.

Flags follow vLLM's names. Prints every backend x every check (pass / fail with reason) and
a one-line verdict, or the same as JSON with --json. Exit codes: 0 accepted, 3 refused,
2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..backends.checks import CHECKS, check_table
from ..config import AddInputs, LoRAConfig, ParallelConfig
from ..deployment import AUTO, Deployment
from ..device import LOCAL, TARGETS, resolve_device
from ..errors import ConfigError, MoeloraError, UnsupportedDeploymentError
from ..oracle import Selection, default_registry, select
from ..presets import resolve_model

EXIT_ACCEPTED, EXIT_USAGE, EXIT_REFUSED = 0, 2, 3


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="check a deployment against every backend")
    p.add_argument("--model", required=True, help="preset name or path to a config.json")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ep = p.add_mutually_exclusive_group()
    ep.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="as in vLLM: experts split over the tp ranks (ep = tp, MoE tp = 1)",
    )
    ep.add_argument(
        "--expert-parallel-size",
        "-ep",
        type=int,
        default=None,
        help="moelora: expert parallel size on top of -tp (ranks = tp * ep)",
    )
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-loras", type=int, default=1, help="adapter slots L")
    p.add_argument("--max-lora-rank", type=int, default=16, help="max rank R")
    p.add_argument("--fully-sharded-loras", action="store_true")
    p.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        help="module names (space or comma separated); default: the experts",
    )
    p.add_argument(
        "--lora-add-inputs",
        choices=[m.value for m in AddInputs],
        default=AddInputs.ADD.value,
        help="how the LoRA delta meets its output",
    )
    p.add_argument("--dtype", default=AUTO, help="auto (the model's), bfloat16, float16, float32")
    p.add_argument("--moe-backend", default=AUTO, help="auto or a backend name")
    p.add_argument("--device", default=LOCAL, help=f"{LOCAL} or one of {', '.join(TARGETS)}")
    graphs = p.add_mutually_exclusive_group()
    graphs.add_argument(
        "--cuda-graphs",
        dest="cuda_graphs",
        action="store_true",
        default=None,
        help="default on cuda devices (as vLLM)",
    )
    graphs.add_argument("--enforce-eager", dest="cuda_graphs", action="store_false")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)


def _parallel(args: argparse.Namespace) -> ParallelConfig:
    tp = args.tensor_parallel_size
    if not args.enable_expert_parallel:
        return ParallelConfig(tp, args.expert_parallel_size or 1, args.fully_sharded_loras)
    if args.fully_sharded_loras:
        raise ConfigError(
            "fully_sharded_loras",
            True,
            "tensor-sharded experts, which expert parallel replaces (as in vLLM)",
            "drop --fully-sharded-loras or --enable-expert-parallel",
        )
    return ParallelConfig(tp=1, ep=tp)


def _lora(args: argparse.Namespace) -> LoRAConfig:
    targets = LoRAConfig().targets
    if args.lora_target_modules:
        names = [n for arg in args.lora_target_modules for n in arg.split(",") if n]
        targets = tuple(names)
    return LoRAConfig(
        enabled=args.enable_lora,
        max_rank=args.max_lora_rank,
        max_loras=args.max_loras,
        targets=targets,
        add_inputs=AddInputs(args.lora_add_inputs),
    )


def build_deployment(args: argparse.Namespace) -> Deployment:
    """The Deployment the flags describe; raises ConfigError on a bad value."""
    device = resolve_device(args.device)
    cuda_graphs = device.kind == "cuda" if args.cuda_graphs is None else args.cuda_graphs
    return Deployment.for_model(
        resolve_model(args.model),
        dtype=args.dtype,
        device=device,
        parallel=_parallel(args),
        lora=_lora(args),
        cuda_graphs=cuda_graphs,
        backend=args.moe_backend,
    )


def resolve(deployment: Deployment) -> dict[str, Any]:
    """The plan as data: every backend's checks, and the oracle's verdict."""
    registry = default_registry()
    backends = [
        {
            "name": name,
            "accepts": all(not reasons for _, reasons in table),
            "checks": [
                {"check": check, "ok": not reasons, "reasons": [r.as_dict() for r in reasons]}
                for check, reasons in table
            ],
        }
        for name, table in (
            (name, check_table(backend.capabilities, deployment))
            for name, backend in registry.items()
        )
    ]
    plan = {"deployment": deployment.as_dict(), "backends": backends}
    try:
        selection = select(deployment, registry)
    except UnsupportedDeploymentError as err:
        return plan | _refusal(deployment, err)
    return plan | _acceptance(selection)


def _acceptance(selection: Selection) -> dict[str, Any]:
    verdict = f"ACCEPTED: {selection.name} (requested {selection.requested}, {selection.how})"
    return {
        "accepted": True,
        "selected": selection.name,
        "how": selection.how,
        "verdict": verdict,
        "error": None,
    }


def _refusal(deployment: Deployment, err: UnsupportedDeploymentError) -> dict[str, Any]:
    failing = "; ".join(str(r) for reasons in err.reasons.values() for r in reasons)
    accept = ", ".join(err.accepting) or "none"
    verdict = f"REFUSED: {deployment.backend} cannot run it ({failing}); would accept: {accept}"
    if deployment.backend == AUTO:
        verdict = "REFUSED: no registered backend accepts this deployment (reasons above)"
    return {
        "accepted": False,
        "selected": None,
        "how": None,
        "verdict": verdict,
        "would_accept": err.accepting,
        "error": str(err),
    }


def render(plan: dict[str, Any]) -> str:
    """The readable table: one row per check, one column per backend, reasons as notes."""
    names = [b["name"] for b in plan["backends"]]
    notes: list[str] = []
    rows = [["check", *names]]
    for index, (check, _) in enumerate(CHECKS):
        row = [check]
        for backend in plan["backends"]:
            cell = backend["checks"][index]
            if cell["ok"]:
                row.append("ok")
                continue
            notes.append(
                f"[{len(notes) + 1}] {backend['name']} {check}: "
                + "; ".join(_reason_text(r) for r in cell["reasons"])
            )
            row.append(f"FAIL [{len(notes)}]")
        rows.append(row)
    rows.append(["verdict", *(_column_verdict(plan, b) for b in plan["backends"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    head = [f"deployment: {_describe(plan['deployment'])}", ""]
    notes = ["", *notes] if notes else []
    return "\n".join([*head, *table, *notes, "", f"verdict: {plan['verdict']}"])


def _reason_text(reason: dict[str, Any]) -> str:
    return f"{reason['field']} = {reason['value']}: needs {reason['needed']}"


def _column_verdict(plan: dict[str, Any], backend: dict[str, Any]) -> str:
    if backend["name"] == plan["selected"]:
        return "SELECTED"
    return "accepts" if backend["accepts"] else "refuses"


def _describe(dep: dict[str, Any]) -> str:
    keys = (
        "name",
        "num_experts",
        "top_k",
        "hidden_size",
        "intermediate_per_partition",
        "activation",
        "routing",
        "dtype",
        "tp",
        "ep",
        "lora_on_experts",
        "device",
        "cuda_graphs",
        "requested_backend",
    )
    return " ".join(f"{k}={dep[k]}" for k in keys)


def run(args: argparse.Namespace) -> int:
    try:
        plan = resolve(build_deployment(args))
    except MoeloraError as err:  # config errors and anything else moelora refuses on purpose
        print(f"moelora plan: {err}", file=sys.stderr)
        if args.json:  # machines get an answer on stdout too
            print(json.dumps({"accepted": False, "verdict": "ERROR", "error": str(err)}, indent=2))
        return EXIT_USAGE
    print(json.dumps(plan, indent=2) if args.json else render(plan))
    return EXIT_ACCEPTED if plan["accepted"] else EXIT_REFUSED
