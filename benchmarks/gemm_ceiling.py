"""What the best grouped GEMM we can call does with a layer's two base GEMMs: the practical
ceiling for the LoRA-free expert GEMMs at prefill sizes, measured beside our kernels.

For each T: the bench's routing (validate.build_inputs, seed 0), pairs sorted by expert and
x rows gathered BEFORE timing (so the gather is free here, unlike in any real layer), then
  grouped: torch._grouped_mm(rows, w13^T, offs) and torch._grouped_mm(z, w2^T, offs)
           (CUTLASS grouped GEMMs on sm_90), no activation, no routing weights, no top-k sum;
  dense:   one cuBLAS matmul of the same [P, H] x [H, 2I] and [P, I] x [I, H] (no grouping:
           the rate these FLOPs get at best).
With --fp8, the same GEMMs on e4m3 operands (W8A8), bf16 out, beside the bf16 ones:
  fp8 grouped:     torch._scaled_grouped_mm, rows and z quantized per row (one fp32 scale a
                   row), the experts per output column (FP8_CHANNEL: one scale per expert and
                   column); CUTLASS rowwise on sm_90. moelora's own format is 128x128 blocks
                   with 1x128 activation groups, which no torch grouped GEMM takes on sm_90:
                   rowwise is the nearest grouped ceiling.
  fp8 dense:       torch._scaled_mm rowwise (scale_a [P, 1], scale_b [1, N]) on expert 0's
                   weight, the shapes of the dense bf16 rows.
  fp8 dense block: torch.nn.functional.scaled_mm with BlockWise1x128 activations and
                   BlockWise128x128 weights (moelora's FP8_BLOCK format, cuBLAS), where this
                   torch has it; otherwise the variant prints why it is unavailable.
  Quantization (activations and weights) is done BEFORE timing and is not timed: the ceiling
  is the GEMMs alone, while a real W8A8 layer also quantizes every GEMM input per token.
  Each fp8 up/down output is checked against the fp32 GEMM of its dequantized operands before
  it is timed; a variant that raises or fails the check prints "unavailable" and goes on.
Each timed under CUDA-graph replay with L2 flushed (runner.time_graph), median of --iters;
eager CUDA events when capture fails. Prints ms and TFLOP/s per GEMM and for both together.

Usage (GPU): python -m benchmarks.gemm_ceiling [--model qwen3-30b-a3b] [--tokens 1024,4096,16384]
             [--fp8]
Legend: T tokens, P = T * top_k pairs, E experts, H hidden, I intermediate, N = S * I.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.ceiling_operands import Operands, Variant, build_operands
from benchmarks.fp8_operands import fp8_variants, quantize_operands
from moelora.bench.floors import _median_ms
from moelora.bench.runner import time_graph
from moelora.compare import compare
from moelora.presets import resolve_model

MESSAGE_CHARS = 200  # torch's dispatcher errors put every backend's name on their first line


def bf16_variants(ops: Operands) -> dict[str, Variant]:
    w13t, w2t = ops.experts.w13.transpose(1, 2), ops.experts.w2.transpose(1, 2)
    up, down = ops.flops_up, ops.flops_down
    return {
        "grouped up": Variant(
            lambda r, o: torch._grouped_mm(r, w13t, offs=o), (ops.rows, ops.offs), up
        ),
        "grouped down": Variant(
            lambda a, o: torch._grouped_mm(a, w2t, offs=o), (ops.z, ops.offs), down
        ),
        "grouped both": Variant(
            lambda r, a, o: (
                torch._grouped_mm(r, w13t, offs=o),
                torch._grouped_mm(a, w2t, offs=o),
            ),
            (ops.rows, ops.z, ops.offs),
            up + down,
        ),
        "dense up": Variant(lambda r: r @ ops.dense13, (ops.rows,), up),
        "dense down": Variant(lambda a: a @ ops.dense2, (ops.z,), down),
    }


def _timed(fn, static: tuple, iters: int) -> tuple[float, str]:
    """(median ms, how it was timed): graph replay with L2 flushed, else eager events."""
    try:
        return time_graph(fn, static, [static], iters), "graph"
    except RuntimeError as err:  # capture refused: time eagerly (L2 warm, a lower bound)
        print(f"  graph capture failed ({str(err).splitlines()[0]}); eager timing")
        return _median_ms(lambda: fn(*static), iters), "eager"


def run_variant(name: str, v: Variant, iters: int, timer=_timed) -> dict:
    """Check (when v.ref is set) and time one variant -> its JSON row. Any failure (an API
    this torch lacks, a layout rule, a wrong result) prints "unavailable" and returns
    {"error": ...}: one variant never ends the run."""
    try:
        row = {}
        if v.ref is not None:
            ids, expected = v.ref()
            check = compare(v.fn(*v.static)[ids], expected, torch.bfloat16)
            if not check.ok:
                raise ValueError(f"output against the dequantized fp32 GEMM: {check}")
            row["rel_err"] = check.rel_err
        ms, how = timer(v.fn, v.static, iters)
    except Exception as err:  # any failure of one variant is reported, never raised
        first = (str(err).splitlines() or [""])[0][:MESSAGE_CHARS]
        print(f"  {name}: unavailable ({type(err).__name__}: {first})")
        return {"error": f"{type(err).__name__}: {first}"}
    return dict(row, ms=ms, tflops=v.flops / (ms / 1e3) / 1e12, timed=how)


def _print(tokens: int, name: str, result: dict) -> None:
    if "ms" not in result:
        return  # run_variant printed why it is unavailable
    checked = f", rel_err {result['rel_err']:.1e}" if "rel_err" in result else ""
    print(
        f"  T={tokens:>6} {name:<23} {result['ms']:8.4f} ms  "
        f"{result['tflops']:6.1f} TFLOP/s ({result['timed']}{checked})"
    )


def measure(model_name: str, tokens: int, iters: int, fp8: bool = False) -> dict:
    """One T's JSON row: each variant's ms / TFLOP/s (and, checked ones, rel_err), or error."""
    ops = build_operands(resolve_model(model_name), tokens, "cuda")
    variants = bf16_variants(ops)
    if fp8:
        variants.update(fp8_variants(ops, quantize_operands(ops)))
    counts = torch.diff(ops.offs, prepend=ops.offs.new_zeros(1))
    row = dict(model=model_name, T=tokens, pairs=ops.rows.shape[0])
    row["experts_hit"] = int((counts > 0).sum())
    for name, v in variants.items():
        row[name] = run_variant(name, v, iters)
        _print(tokens, name, row[name])
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1024,4096,16384")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--fp8", action="store_true", help="also the e4m3 (W8A8) GEMMs")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print(
        f"gemm_ceiling: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
        f"model {args.model}"
    )
    rows = [measure(args.model, int(t), args.iters, args.fp8) for t in args.tokens.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
