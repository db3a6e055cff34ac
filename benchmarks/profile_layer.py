"""Where one layer's time goes: per-kernel GPU time of the triton backend's forward, from
torch.profiler over eager calls (L2 flushed before each), next to the whole layer's
CUDA-graph replay time (the difference is launch gaps and graph overhead).

Usage (GPU): python -m benchmarks.profile_layer [--tokens 1,64,1024,4096,16384] [--iters 10]
             [--model qwen3-30b-a3b] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json

import torch

from moelora.backends.triton import fused_moe_lora
from moelora.bench.runner import FLUSH_BYTES, time_graph
from moelora.call import MoECall
from moelora.inputs import build_experts, build_inputs, build_lora
from moelora.presets import resolve_model
from moelora.tiling.pick import pick_config

FLUSH_TAG = "bitwise_not"  # the flush kernel's name contains this; it is left out


def kernel_times(fwd, static, iters: int) -> dict[str, float]:
    """Mean GPU ms per call of each kernel that fwd launches (summed over its launches)."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        fwd(*static)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.bitwise_not_()
            fwd(*static)
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and FLUSH_TAG not in ev.name:
            totals[_short(ev.name)] += ev.device_time / 1e3 / iters
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def _short(name: str) -> str:
    return name if len(name) < 60 else name[:57] + "..."


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1,64,1024,4096,16384")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--lora-base-tiles",
        action="store_true",
        help="also run +LoRA with the LoRA-free path's tiles (what the LoRA loops cost there)",
    )
    args = p.parse_args()
    model = resolve_model(args.model)
    shape = model.shape
    experts = build_experts(model, "cuda")
    bank = build_lora(model, 8, 16, "cuda")
    dims = (shape.num_experts, shape.top_k, shape.hidden_size, shape.intermediate_size)
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        sets = [build_inputs(model, t, 8, "cuda", seed) for seed in range(2)]
        for s in sets:
            s[3].copy_(torch.arange(t, device="cuda") % 8)
        runs = [("base", None, pick_config(t, *dims)), ("lora", bank, pick_config(t, *dims, True))]
        if args.lora_base_tiles:
            tiles = dataclasses.replace(
                pick_config(t, *dims), shrink_split_k=runs[1][2].shrink_split_k
            )
            runs.append(("lora@base-tiles", bank, tiles))
        for label, lora, cfg in runs:

            def fwd(x, ids, w, slots, lora=lora, cfg=cfg):
                return fused_moe_lora(MoECall(x, ids, w, slots, lora), experts, shape, config=cfg)

            static = tuple(v.clone() for v in sets[0])
            graph_ms = time_graph(fwd, static, sets, 30)
            kernels = kernel_times(fwd, static, args.iters)
            print(f"T={t} {label}: graph {graph_ms:.4f} ms, kernels {sum(kernels.values()):.4f}")
            print(f"   cfg {cfg}")
            for name, ms in kernels.items():
                print(f"   {ms:8.4f}  {name}")
            rows.append(dict(T=t, mode=label, graph_ms=graph_ms, cfg=str(cfg), kernels=kernels))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
