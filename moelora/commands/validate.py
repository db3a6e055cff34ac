"""`moelora validate`: every registered fast backend against the reference on real layer
shapes, in the serving dtype (bf16; `--dtype` for fp16 / fp32), on this machine's GPU.
Prints pass/fail per case.

Cases per model: T sweep (8 adapters, rank 16, eager), CUDA-graph replay with fresh inputs
copied into the captured buffers, ranks 8/16/64/128, 1 adapter, and the LoRA-free path;
--lora-sweep (or --suite lora-sweep) adds the banks of `moelora bench --suite lora-sweep`
(mixed real ranks, padded ranks, 64 and 128 slots, rank 256); --suite ranks adds banks with
garbage past each slot's real rank, eager and graphs. Adapters alternate rank R and R/2 (zero-padded) unless a
case names each slot's rank, and every (L+1)-th token has slot -1.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass

import torch

from ..call import MoECall
from ..compare import compare
from ..config import AddInputs, DeviceFacts, LoRAConfig, ModelConfig
from ..deployment import Deployment
from ..device import probe
from ..errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, ConfigError
from ..inputs import build_bank, build_experts, build_inputs, build_lora, with_padding_garbage
from ..oracle import default_registry, select
from ..presets import PRESETS, resolve_model
from ..quant.formats import resolve_quantization
from ..quant.fp8_experts import FP8ExpertWeights, quantize_experts
from ..reference import moe_lora_reference
from ..weights import ExpertWeights, LoRABank
from .cpu_cost import Cost, validate_cost

MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3", "nemotron-h", "gpt-oss-20b")
TOKENS = (1, 2, 7, 16, 64, 255, 1024, 4096, 16384)
# On a cpu every kernel runs through Triton's interpreter: the two small presets (gated
# and non-gated), T = 1 (decode), 7 and 16, every case capped at the largest T: 9 cases per
# model, about 20 s for both on the shared 2-core CPU machine (with T 64: 30 s; the GPU
# defaults: hours).
CPU_MODELS = ("tiny", "tiny-relu2")
CPU_TOKENS = (1, 7, 16)
REFERENCE = "reference"
FP8 = torch.float8_e4m3fn  # the tolerance row of FP8 experts (moelora/compare.py)


@dataclass(frozen=True)
class Case:
    tokens: int
    adapters: int  # L; 0 = no LoRA bank (base path)
    rank: int  # R of the bank
    graphs: bool
    # each slot's real rank (zero-padded to R); None: alternating R and R/2 (build_lora)
    ranks: tuple[int, ...] | None = None
    garbage: bool = False  # the backend's bank holds garbage past each rank (inputs.py)

    def label(self) -> str:
        lora = f"L={self.adapters} R={self.rank}" if self.adapters else "no LoRA"
        if self.ranks is not None:
            lora += f" ranks={_ranks_text(self.ranks)}"
        padding = " garbage" if self.garbage else ""
        return f"T={self.tokens} {lora}{padding} {'graph' if self.graphs else 'eager'}"


def _ranks_text(ranks: tuple[int, ...]) -> str:
    """8 for (8,) * L, else every slot's rank (as the bench case ids write them)."""
    return str(ranks[0]) if len(set(ranks)) == 1 else ",".join(map(str, ranks))


def sweep_cases(tokens: tuple[int, ...], rank: int = 16) -> list[Case]:
    """The T sweep (--quick runs only this): 8 adapters of rank `rank`, eager."""
    return [Case(t, 8, rank, False) for t in tokens]


# Issue 19's banks (moelora bench --suite lora-sweep times them), each at these T
LORA_SWEEP_TOKENS = (2, 255, 4096)  # one token with an adapter; a partial block; prefill


def lora_sweep_cases() -> list[Case]:
    """--lora-sweep: a mixed bank (real ranks 8, 16, 64, 128 in an R = 128 bank), rank-8
    adapters padded to R = 128, 64 and 128 slots of R = 16 and 8 slots of R = 256 (these
    three alternating R and R/2, as build_lora makes them); eager."""
    banks = [
        (8, 128, (8, 16, 64, 128) * 2),
        (8, 128, (8,) * 8),
        (64, 16, None),
        (8, 256, None),
        (128, 16, None),
    ]
    return [
        Case(t, adapters, rank, False, ranks)
        for adapters, rank, ranks in banks
        for t in LORA_SWEEP_TOKENS
    ]


RANKS_TOKENS = (1, 7, 64, 1024, 4096)


def ranks_cases() -> list[Case]:
    """--suite ranks: banks whose columns past each slot's real rank hold garbage, eager
    and graph replay, against the reference on the clean bank: mixed ranks 8-128 in R =
    128, rank 8 in R = 128, rank 256 / 32, 64 slots of rank 16, and 128 slots of ranks 8 /
    16 with every other slot empty (rank 0)."""
    banks = [
        (128, (8, 16, 64, 128) * 2),
        (128, (8,) * 8),
        (256, (256, 32) * 4),
        (16, (16,) * 64),
        (16, tuple(0 if s % 2 else 8 if s % 4 else 16 for s in range(128))),
    ]
    return [
        Case(t, len(ranks), rank, graphs, ranks, garbage=True)
        for rank, ranks in banks
        for t in RANKS_TOKENS
        for graphs in (False, True)
    ]


# Case sets a GPU check adds to the run (--suite, repeatable)
SUITES = {"lora-sweep": lora_sweep_cases, "ranks": ranks_cases}


def default_cases(tokens: tuple[int, ...] = TOKENS, rank: int = 16) -> list[Case]:
    cases = sweep_cases(tokens, rank)
    cases += [Case(t, 8, 16, True) for t in (1, 255, 4096) if t in tokens or len(tokens) > 3]
    cases += [Case(t, 8, r, False) for r in (8, 64, 128) for t in (64, 1024)]
    cases += [Case(t, 1, 16, False) for t in (7, 1024)]
    cases += [Case(16, 0, 16, False), Case(4096, 0, 16, True)]
    return cases


@dataclass
class Problem:
    model: ModelConfig
    experts: ExpertWeights
    lora: LoRABank | None
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    token_slots: torch.Tensor | None


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def with_dtype(model: ModelConfig, dtype: str | None) -> ModelConfig:
    """model in another dtype (`--dtype`), or as it is (None)."""
    if dtype is None:
        return model
    return dataclasses.replace(model, shape=dataclasses.replace(model.shape, dtype=DTYPES[dtype]))


def with_quantization(model: ModelConfig, flag: str | None) -> ModelConfig:
    """model with its experts stored as `--quantization` says (None: the model's own)."""
    return dataclasses.replace(model, quantization=resolve_quantization(flag, model.quantization))


def build_validated_experts(
    model: ModelConfig, device: str, seed: int
) -> tuple[ExpertWeights | FP8ExpertWeights, ExpertWeights]:
    """(what the backend runs, what the reference multiplies): random experts in the
    serving dtype twice, or, FP8, their quantization and its fp32 dequantization."""
    experts = build_experts(model, device, seed)
    if not model.quantization.method.is_fp8:
        return experts, experts
    fp8 = quantize_experts(experts, model.quantization)
    del experts  # DeepSeek-V3: the bf16 layer (22 GB) goes before the fp32 one is made
    return fp8, fp8.dequantize()


def select_backend(name: str, model: ModelConfig, case: Case, device: DeviceFacts):
    """The backend `name` through the oracle, for exactly what this case runs: a backend the
    oracle would refuse for this deployment is never run (the refusal is the case's error)."""
    lora = LoRAConfig(
        enabled=case.adapters > 0,
        max_rank=case.rank,
        num_slots=max(1, case.adapters),
        add_inputs=AddInputs.OVERWRITE,  # forward without `out` writes y
    )
    deployment = Deployment.for_model(
        model, device=device, lora=lora, cuda_graphs=case.graphs, backend=name
    )
    oracle_log = logging.getLogger("moelora.oracle")
    level = oracle_log.level
    oracle_log.setLevel(logging.WARNING)  # one selection per case: keep the table readable
    try:
        return select(deployment).backend
    finally:
        oracle_log.setLevel(level)


def run_case(
    backend,
    model: ModelConfig,
    experts: ExpertWeights | FP8ExpertWeights,
    case: Case,
    device: str,
    ref_tokens: int,
    seed: int,
    ref_experts: ExpertWeights | None = None,
) -> tuple[object, float]:
    """-> (Comparison on the first ref_tokens rows, seconds). ref_experts: what the
    reference multiplies (FP8 experts: their dequantization, fp32); None: `experts`."""
    ref_experts = experts if ref_experts is None else ref_experts
    start = time.perf_counter()
    clean = (
        build_lora(model, case.adapters, case.rank, device)
        if case.ranks is None
        else build_bank(model, case.ranks, case.rank, device)
    )
    lora = with_padding_garbage(clean) if case.garbage else clean
    woi = model.routing.method.weights_on_input
    x, ids, w, slots = build_inputs(model, case.tokens, case.adapters, device, seed)

    def fwd(x, ids, w, slots):
        return backend.forward(MoECall(x, ids, w, slots, lora, woi), experts, model.shape)

    if case.graphs:
        out = _graph_run(
            fwd,
            (x, ids, w, slots),
            build_inputs(model, case.tokens, case.adapters, device, seed + 1),
        )
    else:
        out = fwd(x, ids, w, slots)
    n = min(case.tokens, ref_tokens)
    s = None if slots is None else slots[:n]
    ref = moe_lora_reference(
        x[:n], ids[:n], w[:n], s, ref_experts, clean, model.shape, weights_on_input=woi
    )
    result = compare(out[:n], ref, FP8 if model.quantization.method.is_fp8 else model.shape.dtype)
    return result, time.perf_counter() - start


def _graph_run(fwd, capture_inputs, fresh_inputs):
    """Capture fwd on capture_inputs, copy fresh_inputs into those buffers, replay: a result
    that matches the reference of fresh_inputs proves nothing was baked in at capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm up outside the capture
            fwd(*capture_inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fwd(*capture_inputs)
    for dst, src in zip(capture_inputs, fresh_inputs):
        if dst is not None:
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


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
        type=int,
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
        choices=sorted(SUITES),
        default=[],
        help="add a suite's cases (repeatable): lora-sweep (as --lora-sweep); ranks (banks "
        f"with garbage past each slot's real rank, R up to 256 and 128 slots, at T "
        f"{','.join(map(str, RANKS_TOKENS))}, eager and graphs)",
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
    models = (args.models or ",".join(MODELS if args.device == "cuda" else CPU_MODELS)).split(",")
    cases = sweep_cases(tokens, args.rank) if args.quick else default_cases(tokens, args.rank)
    for suite in dict.fromkeys(args.suite + ["lora-sweep"] * args.lora_sweep):
        cases += SUITES[suite]()
    if args.device != "cuda":  # no graphs, and no case larger than the largest T asked for
        capped = (dataclasses.replace(c, tokens=min(c.tokens, max(tokens))) for c in cases)
        cases = list(dict.fromkeys(c for c in capped if not c.graphs))
    loaded = [
        (name, with_quantization(with_dtype(resolve_model(name), args.dtype), args.quantization))
        for name in models
    ]
    device = probe() if args.device == "cuda" else probe("cpu")
    if args.device == "cpu":
        _warn_cpu_cost(loaded, cases, args, len(backends), device.interpreted)
    failures = total = 0
    # rel_tol bounds rel_err (||out - ref|| / ||ref||); max_abs is reported, not bounded
    print(
        f"{'backend':<9} {'model':<16} {'case':<34} {'rel_err':>9} {'rel_tol':>7} "
        f"{'max_abs':>9}  result  s"
    )
    for name in backends:
        for model_name, model in loaded:
            experts, ref_experts = build_validated_experts(model, args.device, args.seed)
            for case in cases:
                total += 1
                failures += not _run_one(
                    name, model_name, model, (experts, ref_experts), case, device, args
                )
            del experts, ref_experts
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print(f"validate: {total - failures}/{total} passed" + ("" if not failures else " — FAILURES"))
    return EXIT_FAILED if failures else EXIT_OK


def _run_one(name, model_name, model, weights, case, device, args) -> bool:
    """One table row (weights: the backend's experts and the reference's); True when the
    case passed."""
    ok = False
    experts, ref_experts = weights
    try:
        backend = select_backend(name, model, case, device)
        res, secs = run_case(
            backend, model, experts, case, args.device, args.ref_tokens, args.seed, ref_experts
        )
        line = (
            f"{res.rel_err:9.2e} {res.tol:7.0e} {res.max_abs:9.2e}  "
            f"{'pass' if res.ok else 'FAIL':<6} {secs:5.1f}"
        )
        ok = res.ok
    except Exception as err:  # report and continue: the table is the product
        msg = " ".join(str(err).split())  # refusals span lines
        line = f"ERROR {type(err).__name__}: {msg[:160]}"
    print(f"{name:<9} {model_name:<16} {case.label():<34} {line}", flush=True)
    return ok


def _warn_cpu_cost(loaded, cases, args, backends: int, interpreted: bool) -> None:
    cost = None
    for _, model in loaded:
        one = validate_cost(model, cases, args.ref_tokens, interpreted, model.shape.dtype.itemsize)
        cost = one if cost is None else cost + one
    if cost is not None and backends > 1:
        cost = Cost(cost.seconds * backends, cost.bytes)
    if cost is not None and cost.large:
        print(
            f"moelora validate: warning: {len(cases)} cases per model on this CPU (Triton's "
            f"interpreter) take {cost.describe()} (estimate, moelora/commands/cpu_cost.py). "
            f"Fix: run on a GPU, or --models {','.join(CPU_MODELS)} --tokens "
            f"{','.join(map(str, CPU_TOKENS))} (seconds)",
            file=sys.stderr,
            flush=True,
        )
