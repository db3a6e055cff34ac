"""Benchmark runner: every provider checked against the reference, then timed as CUDA-graph
replays (L2 flushed, fresh inputs copied into the captured buffers before each replay,
median over many replays); JSON stamped with device, versions and commit."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import time

import torch

from .. import cuda_graphs
from ..call import MoECall
from ..compare import compare
from ..device import probe
from ..inputs import build_bank, build_experts, build_inputs
from ..presets import resolve_model
from ..quant.fp8_experts import quantize_experts
from ..quantization import resolve_quantization
from ..reference import reference_forward
from .cases import BenchCase
from .floors import Ceilings, layer_work

FLUSH_BYTES = 256 << 20  # 5x the H200's 50 MB L2
FP8 = torch.float8_e4m3fn  # the tolerance row of FP8 experts (moelora/compare.py)
INPUT_SETS = 4  # fresh inputs rotate among these, copied in outside the timed region


def commit() -> str:
    """MOELORA_COMMIT when set (the device machine's copy of .git can be stale), else git."""
    if os.environ.get("MOELORA_COMMIT"):
        return os.environ["MOELORA_COMMIT"]
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], stderr=subprocess.DEVNULL, text=True
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def stamp(ceil: Ceilings | None) -> dict:
    """Device, versions, commit and time; the ceilings when measured (None: not measured)."""
    import triton

    out = dict(
        device=probe().name,
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        commit=commit(),
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    if ceil is not None:
        out["ceilings"] = dict(bandwidth_Bps=ceil.bandwidth, matmul_flops=ceil.matmul)
    return out


def capture_graph(fwd, static, warmups: int) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, its output) of fwd(*static) captured on the current stream, after `warmups`
    calls on a side stream (they compile the kernels and allocate outside the capture)."""
    captured = cuda_graphs.capture(lambda: fwd(*static), warmups=warmups)
    return captured.graph, captured.out


def time_graph(fwd, static, sets, iters: int) -> float:
    """Median ms of graph replays of fwd(*static); before each, one of `sets` is copied into
    the static buffers and L2 is flushed (outside the events)."""
    graph, _ = capture_graph(fwd, static, warmups=2)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    times = []
    for i in range(iters + 3):
        for dst, src in zip(static, sets[i % len(sets)]):
            if dst is not None:
                dst.copy_(src)
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def run_case(backend, case: BenchCase, ceil: Ceilings, iters: int, experts_cache: dict) -> dict:
    model = resolve_model(case.model)
    model = dataclasses.replace(
        model, quantization=resolve_quantization(case.quantization, model.quantization)
    )
    shape = model.shape
    key = (case.model, model.quantization)
    if key not in experts_cache:
        experts_cache.clear()
        experts_cache[key] = _experts(model)
    experts, ref_experts, weight_bytes = experts_cache[key]
    lora = build_bank(model, case.slot_ranks, case.max_rank, "cuda")
    woi = model.routing.method.weights_on_input
    sets = [
        build_inputs(model, case.tokens, case.adapters, "cuda", seed) for seed in range(INPUT_SETS)
    ]
    # token t -> slot t % L (every token has an adapter), as the vLLM peer assigns them
    for s in sets:
        s[3].copy_(torch.arange(case.tokens, device="cuda") % case.adapters)
    row = dict(
        case=case.id,
        model=case.model,
        T=case.tokens,
        L=case.adapters,
        R=case.max_rank,
        ranks=list(case.slot_ranks),
    )
    for label, bank in (("base", None), ("lora", lora)):

        def fwd(x, ids, w, slots, bank=bank):
            return backend.forward(MoECall(x, ids, w, slots, bank, woi), experts, shape)

        static = tuple(t.clone() for t in sets[0])
        out = fwd(*static)
        n = min(case.tokens, 1024)
        ref = reference_forward(MoECall(*static, bank, woi).head(n), ref_experts, shape)
        cmp = compare(out[:n], ref, FP8 if model.quantization.method.is_fp8 else shape.dtype)
        ms = time_graph(fwd, static, sets, iters)
        work = layer_work(
            static[1],
            static[3],
            shape.hidden_size,
            shape.intermediate_size,
            shape.activation.width_factor,
            case.slot_ranks,
            lora=bank is not None,
            weight_bytes=weight_bytes,
        )
        floor_ms = work.floor_s(ceil) * 1e3
        row[label] = dict(
            ms=ms,
            floor_ms=floor_ms,
            ratio=ms / floor_ms,
            rel_err=cmp.rel_err,
            ok=cmp.ok,
            tflops=work.flops / ms / 1e9,
            gbps=work.bytes / ms / 1e6,
        )
        if not cmp.ok:
            print(f"  {case.id} {label}: CHECK FAILED {cmp}", file=sys.stderr)
    return row


def _experts(model) -> tuple:
    """(what the backend runs, what the reference multiplies, bytes per weight element for
    the floor): the serving dtype, or FP8 experts, their fp32 dequantization and one byte
    plus the scales' share."""
    experts = build_experts(model, "cuda")
    if not model.quantization.method.is_fp8:
        return experts, experts, None
    fp8 = quantize_experts(experts, model.quantization)
    del experts
    weights = fp8.w13.numel() + fp8.w2.numel()
    return fp8, fp8.dequantize(), fp8.nbytes / weights


def dump(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
