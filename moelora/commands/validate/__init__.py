"""`moelora validate`: every registered fast backend against the reference on real layer
shapes, in the serving dtype (bf16; `--dtype` for fp16 / fp32), on this machine's GPU.
Prints pass/fail per case.

Cases per model: T sweep (8 adapters, rank 16, eager), CUDA-graph replay with fresh inputs
copied into the captured buffers, ranks 8/16/64/128, 1 adapter, and the LoRA-free path;
--lora-sweep (or --suite lora-sweep) adds the banks of `moelora bench --suite lora-sweep`
(mixed real ranks, padded ranks, 64 and 128 slots, rank 256); --suite ranks adds banks with
garbage past each slot's real rank, eager and graphs. Adapters alternate rank R and R/2
(zero-padded) unless a case names each slot's rank, and every (L+1)-th token has slot -1.
The cases are cases.py's.

--suite slots | hf | serving | parallel run a check suite instead of the layer table
(suites/: the slot manager under queued GPU work, the transformers integration,
serving hot and cold adapters, the parallel layouts over two processes); named with a layer
suite, the table runs too.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from ...errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, ConfigError
from ...oracle import default_registry
from ...presets import PRESETS
from ..flag_types import positive_int
from .cases import (
    CPU_MODELS,
    CPU_TOKENS,
    LAYER_SUITES,
    LORA_SWEEP_TOKENS,
    MODELS,
    RANKS_TOKENS,
    TOKENS,
)
from .suites import CHECK_SUITES, run_suite
from .table import DTYPES, layer_table

REFERENCE = "reference"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "validate",
        help="check fast backends against the reference on real layer shapes (this GPU; "
        "bf16 unless --dtype)",
        description="Every requested backend against the reference, case by case, on this "
        "machine. Exit codes: 0 every case passed, 1 a case failed or was refused, 2 bad usage.",
    )
    p.add_argument(
        "--models",
        default=None,
        help=f"comma-separated presets ({', '.join(PRESETS)}; `moelora presets` shows their "
        f"shapes), config.json paths or model directories (default: {','.join(MODELS)}; on "
        f"--device cpu: {','.join(CPU_MODELS)})",
    )
    p.add_argument(
        "--tokens",
        default=None,
        help=f"comma-separated token counts T of the sweep (default: {','.join(map(str, TOKENS))}; "
        f"on --device cpu: {','.join(map(str, CPU_TOKENS))}, every case capped at the largest)",
    )
    p.add_argument(
        "--backends",
        default="triton",
        help="comma-separated backends to check (default triton; also grouped_mm): the "
        "reference is what they are compared with",
    )
    p.add_argument(
        "--ref-tokens",
        type=positive_int,
        default=4096,
        help="compare the first N tokens' rows (reference cost grows with T)",
    )
    p.add_argument("--quick", action="store_true", help="T sweep only, eager")
    p.add_argument(
        "--lora-sweep",
        action="store_true",
        help="also the LoRA sweep's banks at T "
        f"{','.join(map(str, LORA_SWEEP_TOKENS))}: real ranks 8/16/64/128 mixed in an "
        "R=128 bank, rank 8 padded to R=128, 64 and 128 slots of rank 16, rank 256 (long on "
        "a CPU: rank 256 and 128 slots)",
    )
    p.add_argument(
        "--suite",
        action="append",
        choices=sorted(LAYER_SUITES) + list(CHECK_SUITES),
        default=[],
        help="a suite (repeatable). Layer suites add cases to the table: lora-sweep (as "
        "--lora-sweep); ranks (banks with garbage past each slot's real rank, R up to 256 "
        f"and 128 slots, at T {','.join(map(str, RANKS_TOKENS))}, eager and graphs). Check "
        "suites run their own cases, one verdict each, instead of the table (with a layer "
        "suite too, both run): "
        + "; ".join(f"{s.name} ({s.summary})" for s in CHECK_SUITES.values()),
    )
    p.add_argument(
        "--rank",
        type=int,
        default=16,
        help="LoRA rank R of the T sweep (8 adapters alternating R and R/2); e.g. 128 for the "
        "largest shared-memory need",
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="where the cases run: cuda (this machine's GPU, the default) or cpu (Triton's "
        "interpreter, TRITON_INTERPRET=1 set for you: small models and T by default, "
        "a warning with the estimate before anything larger)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of weights and inputs")
    p.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="as in vLLM: the experts' storage (default: each model's quantization_config): "
        "fp8 (block-scaled e4m3, the config's block or 128x128), fp8_block, fp8_channel, none; "
        "FP8 experts are the random weights quantized, compared with the reference on their "
        "dequantization (fp32) with the FP8 row of the tolerance table",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="the activations' and weights' dtype (default: each model's, bf16 for the presets)",
    )
    for suite in CHECK_SUITES.values():
        if suite.add_arguments is not None:
            suite.add_arguments(p)
    p.set_defaults(run=run)


def _tokens(text: str | None, device: str) -> tuple[int, ...]:
    if text is None:
        return TOKENS if device == "cuda" else CPU_TOKENS
    try:
        tokens = tuple(int(t) for t in text.split(","))
    except ValueError:
        tokens = ()
    if not tokens or min(tokens) < 1:
        raise ConfigError(
            "--tokens", text, "comma-separated positive integers", "e.g. --tokens 1,7,64"
        )
    return tokens


def _backends(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    registry = default_registry()
    for name in names:
        if name == REFERENCE:
            raise ConfigError(
                "--backends",
                text,
                "fast backends: the reference is what each is compared with, so a check of "
                "it against itself cannot fail",
                f"--backends {','.join(n for n in registry if n != REFERENCE)}",
            )
        if name not in registry:
            raise ConfigError(
                "--backends", text, f"names from {', '.join(registry)}", "--backends triton"
            )
    return names


def run(args: argparse.Namespace) -> int:
    checks = [CHECK_SUITES[name] for name in dict.fromkeys(args.suite) if name in CHECK_SUITES]
    no_gpu = args.device == "cpu" or not torch.cuda.is_available()
    refused = [s for s in checks if no_gpu and s.cpu_refusal]
    for suite in refused:
        print(
            f"moelora validate: --suite {suite.name} needs a CUDA device: {suite.cpu_refusal}. "
            "Fix: run it on a GPU machine (without --device cpu)",
            file=sys.stderr,
        )
    if refused:
        return EXIT_USAGE
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "moelora validate: --device cuda: no CUDA device here. Fix: run it on a GPU "
            f"machine, or pass --device cpu (Triton's interpreter; {','.join(CPU_MODELS)} at "
            "small T by default, seconds)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.device == "cpu":  # before any kernel import, as demo does
        os.environ.setdefault("TRITON_INTERPRET", "1")
    tokens = _tokens(args.tokens, args.device)
    if args.rank < 1:
        raise ConfigError("--rank", args.rank, "a LoRA rank >= 1", "e.g. --rank 16")
    backends = _backends(args.backends)
    for suite in checks:  # every setting refused before anything runs
        if suite.check_args is not None:
            suite.check_args(args, args.device)
    layer_suites = [name for name in args.suite if name in LAYER_SUITES]
    failures = 0
    if not checks or layer_suites or args.lora_sweep:
        failures += layer_table(args, tokens, backends)
    for suite in checks:
        for name in backends if suite.uses_backend else backends[:1]:
            failures += run_suite(suite, args, args.device, name)
    return EXIT_FAILED if failures else EXIT_OK
