"""FP8 tile sweep: the FP8 (W8A8, 128x128 block) layer's time under a grid of tile configs
around the one a forward picks (the bf16 row of its LoRA class, refitted for e4m3), each
checked against the reference with the FP8 tolerance first, timed by the tune's timer (graph
replay, L2 flushed), in one run. Decides FP8 tiles by measurement before any rule is written.

Usage (GPU): python -m benchmarks fp8_sweep [--model qwen3-30b-a3b] [--tokens 256,4096]
             [--iters 20] [--base] [--json out/fp8_sweep.json] [--budget-s 150]
(--base: the LoRA-free layer. Each T prints the picked config's time, then every candidate's,
fastest last; a candidate that fails to compile or mismatches is reported and skipped.)
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time

import torch

from moelora.backends.triton import fused_moe_lora
from moelora.bench.runner import time_graph
from moelora.call import MoECall
from moelora.compare import FP8, compare
from moelora.quant.formats import resolve_quantization
from moelora.quant.fp8_experts import quantize_experts
from moelora.reference import moe_lora_reference
from moelora.tiling.config import GemmTiles, TileConfig
from moelora.tiling.pick import pick_config

from .tune import Layer, fit_like_forward, load_model

# (BLOCK_M, up (BLOCK_N, warps, stages), down (BLOCK_N, warps, stages)): BLOCK_K is the
# scale block's 128 in every FP8 K loop (tiling/quantized.py)
BLOCK_MS = (64, 128)
UP = [(n, w, s) for n in (64, 128) for w in (4, 8) for s in (3, 4)]
DOWN = [(n, w, s) for n in (64, 128, 256) for w in (4, 8) for s in (3, 4)]


class FP8Layer(Layer):
    """Layer on FP8 experts, checked with the FP8 row of the tolerance table."""

    def measure(self, cfg: TileConfig, lora: bool) -> float | None:
        bank = self.lora if lora else None
        shape = self.model.shape

        def fwd(x, ids, w, slots):
            return fused_moe_lora(MoECall(x, ids, w, slots, bank), self.experts, shape, config=cfg)

        static = tuple(t.clone() for t in self.sets[0])
        n = self.n
        if lora not in self.refs:
            self.refs[lora] = moe_lora_reference(
                *(t[:n] for t in static), self.experts, bank, shape, weights_on_input=False
            )
        try:
            if not compare(fwd(*static)[:n], self.refs[lora], FP8).ok:
                print(f"    drop {cfg}: output does not match the reference")
                return None
            return time_graph(fwd, static, self.sets, self.iters)
        except Exception as err:  # out of resources etc.: skip the candidate
            print(f"    skip {cfg}: {type(err).__name__}: {str(err)[:100]}")
            return None


def candidates(start: TileConfig) -> list[TileConfig]:
    """The start with its up tiles, then its down tiles, over the grid (coordinate-wise:
    the up grid at the start's down tiles, the down grid at the start's up tiles), per
    BLOCK_M."""
    out = []
    for block_m in BLOCK_MS:
        base = dataclasses.replace(start, block_m=block_m, decode=False)
        for n, w, s in UP:
            out.append(dataclasses.replace(base, up=GemmTiles(n, 128, w, s)))
        for n, w, s in DOWN:
            out.append(dataclasses.replace(base, down=GemmTiles(n, 128, w, s)))
    return list(dict.fromkeys(out))


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
    del experts
    torch.cuda.empty_cache()
    lora_on = not a.base
    rows = []
    for t in (int(v) for v in a.tokens.split(",")):
        layer = FP8Layer(model, fp8, lora, t, a.iters)
        bank = lora if lora_on else None
        rank, slots = (lora.tile_rank, lora.num_slots) if lora_on else (0, 0)
        picked = fit_like_forward(pick_config(t, *dims, lora=lora_on, rank=rank, slots=slots),
                                  model, bank)  # fmt: skip
        picked_ms = layer.measure(picked, lora_on)
        print(f"T={t} picked {picked_ms} ms  ({picked})", flush=True)
        results = []
        for cfg in candidates(picked):
            if time.monotonic() - start_s > a.budget_s:
                print("  budget reached", flush=True)
                break
            ms = layer.measure(cfg, lora_on)
            if ms is not None:
                results.append((ms, cfg))
        results.sort(key=lambda r: r[0])
        for ms, cfg in itertools.islice(reversed(results), max(0, len(results) - 5), None):
            print(f"  {ms:.4f} ms  bm={cfg.block_m} up={cfg.up} down={cfg.down}", flush=True)
        rows.append(dict(tokens=t, lora=lora_on, picked_ms=picked_ms,
                         picked=dataclasses.asdict(picked),
                         best=[dict(ms=ms, cfg=dataclasses.asdict(c)) for ms, c in results[:5]]))  # fmt: skip
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
