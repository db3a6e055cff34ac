"""What the best grouped GEMM we can call does with a layer's two base GEMMs: the practical
ceiling for the LoRA-free expert GEMMs at prefill sizes, measured beside our kernels.

For each T: the bench's routing (validate.build_inputs, seed 0), pairs sorted by expert and
x rows gathered BEFORE timing (so the gather is free here, unlike in any real layer), then
  grouped: torch._grouped_mm(rows, w13^T, offs) and torch._grouped_mm(z, w2^T, offs)
           (CUTLASS grouped GEMMs on sm_90), no activation, no routing weights, no top-k sum;
  dense:   one cuBLAS matmul of the same [P, H] x [H, 2I] and [P, I] x [I, H] (no grouping:
           the rate these FLOPs get at best).
Each timed under CUDA-graph replay with L2 flushed (runner.time_graph), median of --iters;
eager CUDA events when capture fails. Prints ms and TFLOP/s per GEMM and for both together.

Usage (GPU): python -m benchmarks.gemm_ceiling [--model qwen3-30b-a3b] [--tokens 1024,4096,16384]
"""

from __future__ import annotations

import argparse
import json

import torch

from moelora.bench.floors import _median_ms
from moelora.bench.runner import time_graph
from moelora.inputs import build_experts, build_inputs
from moelora.presets import resolve_model


def _timed(fn, static: tuple, iters: int) -> tuple[float, str]:
    """(median ms, how it was timed): graph replay with L2 flushed, else eager events."""
    try:
        return time_graph(fn, static, [static], iters), "graph"
    except RuntimeError as err:  # capture refused: time eagerly (L2 warm, a lower bound)
        print(f"  graph capture failed ({str(err).splitlines()[0]}); eager timing")
        return _median_ms(lambda: fn(*static), iters), "eager"


def measure(model_name: str, tokens: int, iters: int) -> dict:
    model = resolve_model(model_name)
    s = model.shape
    experts = build_experts(model, "cuda")
    x, ids, _, _ = build_inputs(model, tokens, 0, "cuda", 0)
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=s.num_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = x[order // s.top_k].contiguous()
    pairs = rows.shape[0]
    z = torch.randn(pairs, s.intermediate_size, device="cuda").to(x.dtype)
    w13t, w2t = experts.w13.transpose(1, 2), experts.w2.transpose(1, 2)
    n13 = w13t.shape[2]
    dense13 = torch.randn(s.hidden_size, n13, device="cuda").to(x.dtype)
    dense2 = torch.randn(s.intermediate_size, s.hidden_size, device="cuda").to(x.dtype)
    flops_up = 2.0 * pairs * s.hidden_size * n13
    flops_down = 2.0 * pairs * s.intermediate_size * s.hidden_size
    variants = {
        "grouped up": (lambda r, o: torch._grouped_mm(r, w13t, offs=o), (rows, offs), flops_up),
        "grouped down": (lambda a, o: torch._grouped_mm(a, w2t, offs=o), (z, offs), flops_down),
        "grouped both": (
            lambda r, a, o: (
                torch._grouped_mm(r, w13t, offs=o),
                torch._grouped_mm(a, w2t, offs=o),
            ),
            (rows, z, offs),
            flops_up + flops_down,
        ),
        "dense up": (lambda r: r @ dense13, (rows,), flops_up),
        "dense down": (lambda a: a @ dense2, (z,), flops_down),
    }
    row = dict(model=model_name, T=tokens, pairs=pairs, experts_hit=int((counts > 0).sum()))
    for name, (fn, static, flops) in variants.items():
        ms, how = _timed(fn, static, iters)
        row[name] = dict(ms=ms, tflops=flops / (ms / 1e3) / 1e12, timed=how)
        print(
            f"  T={tokens:>6} {name:<13} {ms:8.4f} ms  {row[name]['tflops']:6.1f} TFLOP/s ({how})"
        )
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1024,4096,16384")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print(
        f"gemm_ceiling: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
        f"model {args.model}"
    )
    rows = [measure(args.model, int(t), args.iters) for t in args.tokens.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
