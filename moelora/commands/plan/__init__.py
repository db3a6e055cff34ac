"""`moelora plan`: check a deployment against every backend, without a GPU.

Flags follow vLLM's names. Prints where each device fact came from, every backend x every
check (pass / fail with reason), where each backend has been validated, and a one-line
verdict (with the fix, on a refusal), or the same as JSON with --json. Exit codes
(moelora.errors, docs/plan.md): 0 accepted, 3 refused by the oracle, 2 bad usage or
configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ...backends.checks import check_table
from ...config import AddInputs, LoRAConfig, ParallelConfig
from ...deployment import AUTO, Deployment
from ...device import LOCAL, TARGETS, counterpart, differences, fact_sources, probe, resolve_device
from ...errors import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, MoeloraError, UnsupportedDeploymentError
from ...oracle import EXPLICIT, Selection, default_registry, select
from ...presets import PRESETS, resolve_model
from ..flag_terms import VLLM_LORA_FLAGS, in_flag_terms
from .text import render
from .validation import validation


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="check a deployment against every backend, before loading any weight (no GPU needed)",
        description="Ask the backend oracle whether a deployment will run and on which backend. "
        "Exit codes: 0 accepted, 3 refused (the fix is printed), 2 bad usage or configuration.",
    )
    p.add_argument(
        "--model",
        required=True,
        help=f"a preset ({', '.join(PRESETS)}; `moelora presets` shows their shapes), a "
        "config.json path, or a model directory holding config.json",
    )
    p.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1, help="TP size (I_p = I / tp)"
    )
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
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (on the experts unless --lora-target-modules says otherwise)",
    )
    p.add_argument("--max-loras", type=int, default=1, help="adapter slots L (default 1)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="max rank R (default 16)")
    p.add_argument(
        "--fully-sharded-loras",
        action="store_true",
        help="as in vLLM: split each expert's LoRA over the tp ranks (A on the rank, down B on "
        "H); a no-op at MoE tp 1, noted in the table",
    )
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
    p.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="as in vLLM: the experts' storage; default the config's quantization_config. "
        "fp8 (the config's FP8 format and weight_block_size; 128x128 blocks when it names "
        "none), fp8_block, fp8_channel (per-token dynamic activations), or none",
    )
    p.add_argument(
        "--moe-backend",
        default=AUTO,
        help=f"auto (the fastest that accepts) or one of {', '.join(default_registry())}",
    )
    p.add_argument(
        "--device",
        default=LOCAL,
        help=f"{LOCAL} (this machine, probed) or a named target, described by moelora's table "
        f"rather than probed: {', '.join(TARGETS)}",
    )
    graphs = p.add_mutually_exclusive_group()
    graphs.add_argument(
        "--cuda-graphs",
        dest="cuda_graphs",
        action="store_true",
        default=None,
        help="capture CUDA graphs (default on cuda devices, as vLLM)",
    )
    graphs.add_argument(
        "--enforce-eager",
        dest="cuda_graphs",
        action="store_false",
        help="no CUDA graphs (as vLLM): what backends that are not graph safe need",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output (one document)")
    p.set_defaults(run=run)


def _parallel(args: argparse.Namespace) -> ParallelConfig:
    tp, fs = args.tensor_parallel_size, args.fully_sharded_loras
    if not args.enable_expert_parallel:
        return ParallelConfig(
            tp, 1 if args.expert_parallel_size is None else args.expert_parallel_size, fs
        )
    return ParallelConfig(tp=1, ep=tp, fully_sharded_loras=fs)  # MoE tp 1: fs is a no-op


def _lora(args: argparse.Namespace) -> LoRAConfig:
    targets = LoRAConfig().targets
    if args.lora_target_modules:
        names = [n for arg in args.lora_target_modules for n in arg.split(",") if n]
        targets = tuple(names)
    return LoRAConfig(
        enabled=args.enable_lora,
        max_rank=args.max_lora_rank,
        num_slots=args.max_loras,
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
        quantization=args.quantization,
        device=device,
        parallel=_parallel(args),
        lora=_lora(args),
        cuda_graphs=cuda_graphs,
        backend=args.moe_backend,
    )


def notes(args: argparse.Namespace, deployment: Deployment) -> list[str]:
    """What the table should say beside the checks: flags accepted as no-ops, and where a
    named target and this machine disagree about the same kind of machine."""
    out = []
    if args.fully_sharded_loras and deployment.parallel.tp == 1:
        why = (
            "expert parallel leaves the MoE layer at tp 1" if deployment.parallel.ep > 1 else "tp 1"
        )
        out.append(
            f"--fully-sharded-loras at MoE tp 1 ({why}) is a no-op: there is no TP group to "
            "split the LoRA over, so it runs unsharded (as vLLM accepts it at tp 1)"
        )
    if args.device == LOCAL:
        name = counterpart(deployment.device)
        if name:
            out += differences(name, resolve_device(name), deployment.device)
    else:
        out += differences(args.device.lower(), deployment.device, probe())
    return out


def resolve(deployment: Deployment, device_arg: str = LOCAL, extra_notes=()) -> dict[str, Any]:
    """The plan as data: device facts and their sources, every backend's checks and
    validation, notes, and the oracle's verdict."""
    registry = default_registry()
    backends = []
    for name, backend in registry.items():
        table = check_table(backend.capabilities, deployment)
        backends.append(
            {
                "name": name,
                "accepts": all(not reasons for _, reasons in table),
                "checks": [
                    {"check": check, "ok": not reasons, "reasons": [r.as_dict() for r in reasons]}
                    for check, reasons in table
                ],
                "validation": validation(name, backend.capabilities, deployment),
            }
        )
    plan = {
        "deployment": deployment.as_dict(),
        "device_facts": [vars(f) for f in fact_sources(device_arg, deployment.device)],
        "device_arg": device_arg,
        "device_source": "probed" if device_arg == LOCAL else "named target",
        "backends": backends,
        "notes": list(extra_notes),
    }
    try:
        selection = select(deployment, registry)
    except UnsupportedDeploymentError as err:
        return plan | _refusal(deployment, err)
    return plan | _acceptance(selection, plan)


def _acceptance(selection: Selection, plan: dict[str, Any]) -> dict[str, Any]:
    how = (
        "requested explicitly" if selection.how == EXPLICIT else "auto: the fastest that runs here"
    )
    interpreted = " (interpreted: Triton's CPU interpreter, slow)" if selection.interpreted else ""
    verdict = f"ACCEPTED: {selection.name}{interpreted}, {how}"
    [chosen] = [b for b in plan["backends"] if b["name"] == selection.name]
    warning = chosen["validation"]["warning"]
    return {
        "accepted": True,
        "selected": selection.name,
        "how": selection.how,
        "verdict": verdict,
        "error": None,
        "warnings": [warning] if warning else [],
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
        "nearest": [{"backend": name, "changes": list(changes)} for name, changes in err.nearest],
        "fix": err.fix,
        "error": str(err),
        "warnings": [],
    }


def run(args: argparse.Namespace) -> int:
    try:
        deployment = build_deployment(args)
        plan = resolve(deployment, args.device, notes(args, deployment))
    except MoeloraError as err:  # config errors and anything else moelora refuses on purpose
        message = in_flag_terms(str(err), VLLM_LORA_FLAGS)
        print(f"moelora plan: {message}", file=sys.stderr)
        if args.json:  # machines get an answer on stdout too
            error = {"accepted": False, "verdict": "ERROR", "exit_code": EXIT_USAGE}
            print(json.dumps(error | {"error": message}, indent=2))
        return EXIT_USAGE
    print(json.dumps(plan, indent=2) if args.json else render(plan))
    for warning in plan["warnings"]:
        print(f"moelora plan: warning: {warning}", file=sys.stderr)
    if not plan["accepted"]:
        print(f"moelora plan: refused. Fix: {plan['fix']}", file=sys.stderr)
    return EXIT_OK if plan["accepted"] else EXIT_REFUSED
