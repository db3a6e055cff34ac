"""Same-run A/B of one TileConfig knob on the committed configs: for each T, the layer with
LoRA under each value (the tune's timer: graph replay, L2 flushed, output checked against
the reference first).

Usage (GPU): python -m benchmarks.ab_knob --knob expand_lanes --values 16,32,64
             [--tokens 64,1024,4096,16384] [--iters 20] [--model qwen3-30b-a3b]
(Booleans as 0 / 1.)
"""

from __future__ import annotations

import argparse
import dataclasses

from moelora.commands.validate import build_experts, build_lora
from moelora.kernels.configs import TileConfig, pick_config
from moelora.presets import resolve_model

from .tune import Layer


def _value(knob: str, text: str):
    kind = type(getattr(TileConfig(16, None, None), knob))
    return bool(int(text)) if kind is bool else kind(text)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--knob", required=True, help="a TileConfig field, e.g. expand_lanes")
    p.add_argument("--values", required=True, help="comma-separated (0/1 for booleans)")
    p.add_argument("--tokens", default="64,1024,4096,16384")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--model", default="qwen3-30b-a3b")
    args = p.parse_args()
    model = resolve_model(args.model)
    shape = model.shape
    dims = (shape.num_experts, shape.top_k, shape.hidden_size, shape.intermediate_size)
    experts = build_experts(model, "cuda")
    lora = build_lora(model, 8, 16, "cuda")
    values = [_value(args.knob, v) for v in args.values.split(",")]
    print(f"{'T':>6} " + " ".join(f"{args.knob}={v!s:>6}" for v in values))
    for t in (int(v) for v in args.tokens.split(",")):
        layer = Layer(model, experts, lora, t, args.iters)
        base = pick_config(t, *dims, lora=True)
        times = [layer.measure(dataclasses.replace(base, **{args.knob: v}), True) for v in values]
        cells = " ".join(
            f"{'drop' if ms is None else f'{ms:.4f}':>{len(args.knob) + 7}}" for ms in times
        )
        print(f"{t:>6} {cells}", flush=True)


if __name__ == "__main__":
    main()
