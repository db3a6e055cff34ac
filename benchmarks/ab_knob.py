"""Same-run A/B of one TileConfig knob on the committed configs: for each T, the layer with
LoRA (--base: without) under each value (the tune's timer: graph replay, L2 flushed, output checked against
the reference first).

Usage (GPU): python -m benchmarks.ab_knob --knob expand_lanes --values 16,32,64
             [--tokens 64,1024,4096,16384] [--iters 20] [--model qwen3-30b-a3b]
             [--set lora_delta=1,z_sorted=1] [--adapters 64 --rank 16] [--reps 2]
(--set fixes other knobs on every side first, e.g. the knobs that only act with lora_delta.
Each side starts from the config a forward of the bank would run: its LoRA class's table row
fitted to the GPU. With --reps > 1 the values are measured in alternating order and the best
of the rounds is kept; the last column is the last value's time over the first's.)
(Scalar and tuple knobs; booleans as 0 / 1, tuples as AxB. At a T whose row is a decode
config the LoRA knobs of the aligned path change nothing.)
"""

from __future__ import annotations

import argparse
import dataclasses

from moelora.tiling.config import TileConfig
from moelora.tiling.pick import pick_config

from .tune import Layer, fit_like_forward, load_model


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


def picked(t: int, dims: tuple, lora_on: bool, model, bank) -> TileConfig:
    """The config a forward of this bank would run (the table row of its LoRA class, fitted
    to this GPU's shared memory as forward_plan fits it)."""
    rank, slots = (bank.tile_rank, bank.num_slots) if lora_on else (0, 0)
    cfg = pick_config(t, *dims, lora=lora_on, rank=rank, slots=slots)
    return fit_like_forward(cfg, model, bank if lora_on else None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--knob", required=True, help="a TileConfig field, e.g. expand_lanes")
    p.add_argument("--values", required=True, help="comma-separated (0/1 for booleans)")
    p.add_argument("--tokens", default="64,1024,4096,16384")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--adapters", type=int, default=8, help="LoRA slots (token t on t %% L)")
    p.add_argument("--rank", type=int, default=16, help="every slot's rank")
    p.add_argument(
        "--reps", type=int, default=1, help="rounds, the values' order reversed every other one"
    )
    p.add_argument("--set", default="", help="knob=value,... applied to every side first")
    p.add_argument("--base", action="store_true", help="the LoRA-free layer (its table rows)")
    args = p.parse_args()
    fixed = parse_set(args.set)
    model, dims, experts, lora = load_model(args.model, args.adapters, args.rank)
    values = [_value(args.knob, v) for v in args.values.split(",")]
    print(f"{args.adapters} x {args.rank}{' (LoRA-free)' if args.base else ''}, fixed: "
          f"{fixed or 'nothing'}, best of {args.reps} alternated rounds")  # fmt: skip
    print(f"{'T':>6} " + " ".join(f"{args.knob}={v!s:>6}" for v in values) + "   ratio")
    for t in (int(v) for v in args.tokens.split(",")):
        layer = Layer(model, experts, lora, t, args.iters)
        lora_on = not args.base
        base = dataclasses.replace(picked(t, dims, lora_on, model, lora), **fixed)
        best: dict[int, float | None] = {}
        for rep in range(args.reps):
            order = range(len(values)) if rep % 2 == 0 else reversed(range(len(values)))
            for i in order:
                ms = layer.measure(dataclasses.replace(base, **{args.knob: values[i]}), lora_on)
                if ms is not None and (best.get(i) is None or ms < best[i]):
                    best[i] = ms
                best.setdefault(i, ms)
        times = [best[i] for i in range(len(values))]
        cells = " ".join(
            f"{'drop' if ms is None else f'{ms:.4f}':>{len(args.knob) + 7}}" for ms in times
        )
        ratio = f"{times[-1] / times[0]:.3f}" if None not in (times[0], times[-1]) else "-"
        print(f"{t:>6} {cells}   {ratio}  ({base})", flush=True)


if __name__ == "__main__":
    main()
