"""The layer table of `moelora validate`: each backend, model and case of cases.py
run on random inputs and compared with the reference, one line per case.

Legend: T tokens, L slots, R the bank's rank, H hidden, E experts.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from ...bench.runner import capture_graph
from ...call import MoECall
from ...compare import compare
from ...config import ModelConfig
from ...device import probe
from ...inputs import build_bank, build_experts, build_inputs, build_lora, with_padding_garbage
from ...presets import resolve_model
from ...quant.fp8_experts import FP8ExpertWeights, quantize_experts
from ...quantization import resolve_quantization
from ...reference import moe_lora_reference
from ...weights import ExpertWeights
from ..case_backend import case_backend
from ..cpu_cost import Cost, validate_cost
from .cases import (
    CPU_MODELS,
    CPU_TOKENS,
    LAYER_SUITES,
    MODELS,
    Case,
    default_cases,
    sweep_cases,
)

FP8 = torch.float8_e4m3fn  # the tolerance row of FP8 experts (moelora/compare.py)
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
    graph, out = capture_graph(fwd, capture_inputs, warmups=2)
    for dst, src in zip(capture_inputs, fresh_inputs):
        if dst is not None:
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


def layer_table(args: argparse.Namespace, tokens: tuple[int, ...], backends: list[str]) -> int:
    """Every backend, model and case of the table, one line each; returns the failures."""
    models = (args.models or ",".join(MODELS if args.device == "cuda" else CPU_MODELS)).split(",")
    cases = sweep_cases(tokens, args.rank) if args.quick else default_cases(tokens, args.rank)
    layer_suites = [name for name in args.suite if name in LAYER_SUITES]
    for suite in dict.fromkeys(layer_suites + ["lora-sweep"] * args.lora_sweep):
        cases += LAYER_SUITES[suite]()
    if args.device != "cuda":  # no graphs, and no case larger than the largest T asked for
        capped = (dataclasses.replace(c, tokens=min(c.tokens, max(tokens))) for c in cases)
        cases = list(dict.fromkeys(c for c in capped if not c.graphs))
    loaded = [
        (name, with_quantization(with_dtype(resolve_model(name), args.dtype), args.quantization))
        for name in models
    ]
    device = probe() if args.device == "cuda" else probe("cpu")
    if args.device == "cpu":
        warn_cpu_cost(loaded, cases, args, len(backends), device.interpreted)
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
    return failures


def _run_one(name, model_name, model, weights, case, device, args) -> bool:
    """One table row (weights: the backend's experts and the reference's); True when the
    case passed."""
    ok = False
    experts, ref_experts = weights
    try:
        backend = case_backend(
            name,
            model,
            device,
            adapters=case.adapters,
            max_rank=case.rank,
            cuda_graphs=case.graphs,
        )
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


def warn_cpu_cost(loaded, cases, args, backends: int, interpreted: bool) -> None:
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
