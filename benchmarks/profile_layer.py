"""Where one layer's time goes: per-kernel GPU time of the triton backend's forward, from
torch.profiler over eager calls (L2 flushed before each), next to the whole layer's
CUDA-graph replay time (the difference is launch gaps and graph overhead).

Usage (GPU): python -m benchmarks.profile_layer [--tokens 1,64,1024,4096,16384] [--iters 10]
             [--model qwen3-30b-a3b] [--adapters 8] [--rank 16] [--quantization fp8]
             [--json out.json]
The +LoRA run takes the config the backend picks for the bank's LoRA class (as `moelora
bench` runs it); --quantization fp8 profiles block-scaled e4m3 experts. --ncu-window runs, after
warm-up, one eager forward of each mode between cudaProfilerStart / Stop and times nothing,
for Nsight Compute's counters of exactly those launches:
    PYTHONPATH=$PWD ncu --profile-from-start off --clock-control none --csv \
        --metrics gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,... \
        python -m benchmarks.profile_layer --tokens 4096 --ncu-window
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json

import torch

from moelora.backends.triton import forward_plan, fused_moe_lora
from moelora.bench.runner import FLUSH_BYTES, time_graph
from moelora.call import MoECall
from moelora.inputs import build_experts, build_inputs, build_lora
from moelora.presets import resolve_model
from moelora.quant.fp8_experts import quantize_experts
from moelora.quantization import resolve_quantization
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


def profiler_window(fwd, static) -> None:
    """Three warm-up calls (compiles, autotune-free), then one call inside the CUDA profiler's
    window (ncu --profile-from-start off records only that one)."""
    for _ in range(3):
        fwd(*static)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fwd(*static)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _short(name: str) -> str:
    return name if len(name) < 60 else name[:57] + "..."


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1,64,1024,4096,16384")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--adapters", type=int, default=8, help="slots of the bank (every token has one)"
    )
    p.add_argument("--rank", type=int, default=16, help="the bank's rank")
    p.add_argument("--quantization", default=None, help="the experts' storage (none, fp8)")
    p.add_argument(
        "--lora-base-tiles",
        action="store_true",
        help="also run +LoRA with the LoRA-free path's tiles (what the LoRA loops cost there)",
    )
    p.add_argument(
        "--ncu-window",
        action="store_true",
        help="no timing: one forward per mode inside cudaProfilerStart / Stop (for ncu)",
    )
    args = p.parse_args()
    model = resolve_model(args.model)
    quant = resolve_quantization(args.quantization, model.quantization)
    shape = model.shape
    experts = build_experts(model, "cuda")
    if quant.method.is_fp8:
        experts = quantize_experts(experts, quant)
    bank = build_lora(model, args.adapters, args.rank, "cuda")
    dims = (shape.num_experts, shape.top_k, shape.hidden_size, shape.intermediate_size)
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        sets = [build_inputs(model, t, args.adapters, "cuda", seed) for seed in range(2)]
        for s in sets:
            s[3].copy_(torch.arange(t, device="cuda") % args.adapters)
        runs = [("base", None, None), ("lora", bank, None)]
        if args.lora_base_tiles:
            picked = forward_plan(sets[0][0], sets[0][1], experts, bank, shape).tiles
            tiles = dataclasses.replace(pick_config(t, *dims), shrink_split_k=picked.shrink_split_k)
            runs.append(("lora@base-tiles", bank, tiles))
        for label, lora, cfg in runs:

            def fwd(x, ids, w, slots, lora=lora, cfg=cfg):
                return fused_moe_lora(MoECall(x, ids, w, slots, lora), experts, shape, config=cfg)

            if cfg is None:
                cfg = forward_plan(sets[0][0], sets[0][1], experts, lora, shape).tiles
            static = tuple(v.clone() for v in sets[0])
            if args.ncu_window:
                profiler_window(fwd, static)
                continue
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
