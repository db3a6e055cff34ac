"""FP8 tile sweep: the FP8 (W8A8, 128x128 block) layer's time under a grid of tile configs
around the one a forward picks (the bf16 row of its LoRA class, refitted for e4m3), each
checked against the reference with the FP8 tolerance first, timed by the tune's timer (graph
replay, L2 flushed), in one run. Decides FP8 tiles by measurement before any rule is written.

Usage (GPU): python -m benchmarks fp8_sweep [--model qwen3-30b-a3b] [--tokens 256,4096]
             [--iters 20] [--base] [--json out/fp8_sweep.json] [--budget-s 150]
(--base: the LoRA-free layer. A coordinate search per T from the picked config: BLOCK_M,
the up tiles, the down tiles, the LoRA path; each T prints the picked and the best config
with their times; a candidate that fails to compile or mismatches is reported and skipped.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from moelora.quant.fp8_experts import quantize_experts
from moelora.quantization import resolve_quantization
from moelora.tiling.config import GemmTiles, TileConfig
from moelora.tiling.pick import pick_config

from .tune import Layer, fit_like_forward, load_model

FP8 = torch.float8_e4m3fn  # the FP8 row of the tolerance table (moelora/compare.py)

# the grid, BLOCK_K being the scale block's 128 in every FP8 K loop (tiling/quantized.py)
BLOCK_MS = (16, 32, 64, 128)
UP = [(n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (3, 4)]
DOWN = [(n, w, s) for n in (64, 128, 256) for w in (4, 8) for s in (3, 4)]
# the LoRA paths: the in-GEMM expand, or the delta over the shrink tiles (added by the
# GEMMs, or the down one by the top-k reduce)
LORA_PATHS = [
    dict(lora_delta=False, shrink_expand=False, delta_in_reduce=False, expand_first=False),
    dict(lora_delta=False, shrink_expand=False, delta_in_reduce=False, expand_first=True),
    dict(lora_delta=True, shrink_expand=True, delta_in_reduce=False, expand_first=False),
    dict(lora_delta=True, shrink_expand=True, delta_in_reduce=True, expand_first=False),
]


class Search:
    """Coordinate descent from a start: BLOCK_M, then the up tiles, the down tiles and the
    LoRA path, each step keeping the fastest (every measured config logged), until the
    budget runs out."""

    def __init__(self, layer: Layer, lora: bool, deadline: float) -> None:
        self.layer, self.lora, self.deadline = layer, lora, deadline
        self.best, self.best_ms, self.log = None, None, []

    def consider(self, cfg: TileConfig) -> None:
        if time.monotonic() > self.deadline or cfg in (c for c, _ in self.log):
            return
        ms = self.layer.measure(cfg, self.lora)
        self.log.append((cfg, ms))
        if ms is not None and (self.best_ms is None or ms < self.best_ms):
            self.best, self.best_ms = cfg, ms

    def run(self, start: TileConfig) -> None:
        self.consider(start)
        base = dataclasses.replace(start, decode=False)
        for block_m in BLOCK_MS:
            self.consider(dataclasses.replace(base, block_m=block_m))
        steps = [lambda c, t=t: dataclasses.replace(c, up=GemmTiles(t[0], 128, t[1], t[2]))
                 for t in UP]  # fmt: skip
        downs = [lambda c, t=t: dataclasses.replace(c, down=GemmTiles(t[0], 128, t[1], t[2]))
                 for t in DOWN]  # fmt: skip
        paths = (
            [lambda c, k=k: dataclasses.replace(c, **k) for k in LORA_PATHS] if self.lora else []
        )
        for group in (steps, downs, paths):
            center = self.best or base
            for step in group:
                self.consider(step(center))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="256,4096")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--base", action="store_true", help="the LoRA-free layer")
    p.add_argument("--json", default=None)
    p.add_argument("--budget-s", type=float, default=150.0, help="stop starting candidates after")
    a = p.parse_args()
    start_s = time.monotonic()
    model, dims, experts, lora = load_model(a.model)
    quant = resolve_quantization("fp8", model.quantization)
    model = dataclasses.replace(model, quantization=quant)
    fp8 = quantize_experts(experts, quant)
    reference = fp8.dequantize()  # the reference's W8A8 runs on the fp32 dequantization
    del experts
    torch.cuda.empty_cache()
    lora_on = not a.base
    rows = []
    tokens = [int(v) for v in a.tokens.split(",")]
    for n, t in enumerate(tokens):
        layer = Layer(model, fp8, lora, t, a.iters, ref_experts=reference, tol=FP8)
        bank = lora if lora_on else None
        rank, slots = (lora.tile_rank, lora.num_slots) if lora_on else (0, 0)
        picked = fit_like_forward(pick_config(t, *dims, lora=lora_on, rank=rank, slots=slots),
                                  model, bank)  # fmt: skip
        # each T gets an equal share of what is left
        share = (a.budget_s - (time.monotonic() - start_s)) / (len(tokens) - n)
        search = Search(layer, lora_on, time.monotonic() + share)
        search.run(picked)
        picked_ms = search.log[0][1]
        print(f"T={t} picked {picked_ms} ms ({picked})", flush=True)
        print(f"T={t} best {search.best_ms} ms ({search.best})  of {len(search.log)}", flush=True)
        rows.append(dict(tokens=t, lora=lora_on, picked_ms=picked_ms,
                         picked=dataclasses.asdict(picked), best_ms=search.best_ms,
                         best=dataclasses.asdict(search.best) if search.best else None,
                         log=[dict(ms=ms, cfg=dataclasses.asdict(c)) for c, ms in search.log]))  # fmt: skip
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
