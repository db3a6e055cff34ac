"""Same-run A/B of the decode path against the aligned path at small T: for each T, the
layer (LoRA off and on) under the decode config (the table row when it is one, else
DECODE_TILES) and under the aligned config (the table row when it is aligned, else
the off-table heuristic with the LoRA rules: configs.aligned_config). The tune's timer:
graph replay, L2 flushed, output checked first.

Usage (GPU): python -m benchmarks.ab_decode [--tokens 1,2,4,8,16] [--iters 20]
"""

from __future__ import annotations

import argparse

from moelora.tiling.heuristic import DECODE_TILES, aligned_config
from moelora.tiling.pick import pick_config

from .tune import Layer, load_model


def _pair(tokens: int, dims: tuple, lora: bool) -> tuple:
    """(decode config, aligned config) for this T."""
    cfg = pick_config(tokens, *dims, lora=lora)
    aligned = aligned_config(cfg, tokens, dims[0], dims[1], lora)
    return (cfg if cfg.decode else DECODE_TILES), aligned


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,2,4,8,16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--model", default="qwen3-30b-a3b")
    args = p.parse_args()
    model, dims, experts, lora = load_model(args.model)
    print(f"{'T':>5} {'lora':>5} {'decode ms':>10} {'aligned ms':>11}  decode tiles")
    for t in (int(v) for v in args.tokens.split(",")):
        layer = Layer(model, experts, lora, t, args.iters)
        for on in (False, True):
            dec, ali = _pair(t, dims, on)
            d_ms, a_ms = layer.measure(dec, on), layer.measure(ali, on)
            cells = " ".join(f"{'drop' if v is None else f'{v:.4f}':>10}" for v in (d_ms, a_ms))
            print(f"{t:>5} {on!s:>5} {cells}  up {dec.up} down {dec.down}", flush=True)


if __name__ == "__main__":
    main()
