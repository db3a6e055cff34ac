"""Same-run A/B of one TileConfig knob on the committed configs: for each T, the layer with
LoRA (--base: without) under each value (the tune's timer: graph replay, L2 flushed, output checked against
the reference first).

Usage (GPU): python -m benchmarks.ab_knob --knob expand_lanes --values 16,32,64
             [--tokens 64,1024,4096,16384] [--iters 20] [--model qwen3-30b-a3b]
             [--set lora_delta=1,z_sorted=1]
(--set fixes other knobs on every side first, e.g. the knobs that only act with lora_delta.)
(Scalar and tuple knobs; booleans as 0 / 1, tuples as AxB. At a T whose row is a decode
config the LoRA knobs of the aligned path change nothing.)
"""

from __future__ import annotations

import argparse
import dataclasses

from moelora.tiling.config import TileConfig
from moelora.tiling.pick import pick_config

from .tune import Layer, load_model


def _value(knob: str, text: str):
    """A knob's value from text: 0 / 1 for booleans, AxB for tuples (decode_shrink=1x2048)."""
    kind = type(getattr(TileConfig(16, None, None), knob))
    if kind is tuple:
        return tuple(int(v) for v in text.split("x"))
    return bool(int(text)) if kind is bool else kind(text)


def parse_set(text: str) -> dict:
    """'knob=value,...' (TileConfig fields) -> {knob: value}."""
    fixed = {}
    for item in filter(None, text.split(",")):
        knob, sep, value = item.partition("=")
        if not sep or not hasattr(TileConfig(16, None, None), knob):
            raise SystemExit(f"--set: {item!r} is not knob=value with a TileConfig field")
        fixed[knob] = _value(knob, value)
    return fixed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--knob", required=True, help="a TileConfig field, e.g. expand_lanes")
    p.add_argument("--values", required=True, help="comma-separated (0/1 for booleans)")
    p.add_argument("--tokens", default="64,1024,4096,16384")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--set", default="", help="knob=value,... applied to every side first")
    p.add_argument("--base", action="store_true", help="the LoRA-free layer (its table rows)")
    args = p.parse_args()
    fixed = parse_set(args.set)
    model, dims, experts, lora = load_model(args.model)
    values = [_value(args.knob, v) for v in args.values.split(",")]
    print(f"fixed: {fixed or 'nothing'}")
    print(f"{'T':>6} " + " ".join(f"{args.knob}={v!s:>6}" for v in values))
    for t in (int(v) for v in args.tokens.split(",")):
        layer = Layer(model, experts, lora, t, args.iters)
        lora_on = not args.base
        base = dataclasses.replace(pick_config(t, *dims, lora=lora_on), **fixed)
        times = [
            layer.measure(dataclasses.replace(base, **{args.knob: v}), lora_on) for v in values
        ]
        cells = " ".join(
            f"{'drop' if ms is None else f'{ms:.4f}':>{len(args.knob) + 7}}" for ms in times
        )
        print(f"{t:>6} {cells}", flush=True)


if __name__ == "__main__":
    main()
