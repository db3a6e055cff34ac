"""Same-run timing of the routing alignment alone (align_pairs), LoRA-free and with slots,
under variants of its launch constants, plus each launch's GPU time from torch.profiler.

Usage (GPU): python -m benchmarks.ab_align [--tokens 256,1024,4096,16384] [--iters 50]
             [--variants "BLOCK_P=1024;BLOCK_P=256,ALIGN_WARPS=8"]
Each variant sets module constants of moelora.tiling.align_launch for its run only: three-launch
mode BLOCK_P, ALIGN_WARPS, OFFSETS_WARPS; one-program mode (P <= SINGLE_PROGRAM_PAIRS)
SINGLE_BLOCK_P, SINGLE_WARPS, or WIDE_BLOCK_P, WIDE_WARPS above WIDE_SINGLE_PAIRS pairs.
(A constant of the other mode changes nothing at that T.) The layout (each expert's pairs,
the blocks' experts, the used length, the LoRA tile count) is checked against the default
variant's before timing.
"""

from __future__ import annotations

import argparse

import torch

from moelora.bench.runner import time_graph
from moelora.inputs import build_inputs
from moelora.kernels import align
from moelora.presets import resolve_model
from moelora.tiling import align_launch as policy
from moelora.tiling.pick import pick_config


def _parse(text: str) -> list[dict[str, int]]:
    variants = []
    for item in text.split(";"):
        fields = {}
        for kv in filter(None, item.split(",")):
            name, sep, value = kv.partition("=")
            if not sep or not hasattr(policy, name):
                raise SystemExit(
                    f"--variants: {kv!r} is not NAME=int with NAME in tiling/align_launch.py"
                )
            fields[name] = int(value)
        variants.append(fields)
    return variants


def _layout(a: align.AlignedPairs) -> tuple:
    """The layout as a comparable value: the used length, each block's expert, each
    expert's pairs as a set (the order inside a slot's run follows the atomics), and the
    number of LoRA shrink tiles."""
    n = int(a.num_padded.item())
    ids = a.sorted_pair_ids[:n].view(-1, a.block_m).cpu().tolist()
    experts = a.block_experts[: n // a.block_m].cpu().tolist()
    per_expert: dict[int, set] = {}
    for e, row in zip(experts, ids):
        per_expert.setdefault(e, set()).update(row)
    tiles = None if a.num_lora_tiles is None else int(a.num_lora_tiles.item())
    return n, experts, per_expert, tiles


def _launch_times(fwd, iters: int) -> list[float]:
    from torch.profiler import ProfilerActivity, profile

    fwd()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fwd()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    per_call = len(events) // iters
    return [
        sum(events[i * per_call + j].device_time for i in range(iters)) / iters / 1000
        for j in range(per_call)
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="256,1024,4096,16384")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--variants", default="BLOCK_P=1024")
    args = p.parse_args()
    model = resolve_model(args.model)
    shape = model.shape
    variants = _parse(args.variants)
    defaults = {name: getattr(policy, name) for v in variants for name in v}
    for t in (int(v) for v in args.tokens.split(",")):
        _, ids, _, slots = build_inputs(model, t, args.adapters, "cuda", seed=t)
        for lora in (False, True):
            cfg = pick_config(t, shape.num_experts, shape.top_k, shape.hidden_size,
                              shape.intermediate_size, lora=lora)  # fmt: skip
            tile_m = cfg.shrink_block_m if lora else 0

            def fwd(ids=ids, slots=slots if lora else None, bm=cfg.block_m, tile_m=tile_m):
                launch = policy.align_launch(ids.numel(), shape.num_experts)
                return align.align_pairs(
                    ids, slots, shape.num_experts, args.adapters, bm, tile_m, launch=launch
                )

            want = _layout(fwd())
            cells = []
            for v in variants:
                for name, value in {**defaults, **v}.items():
                    setattr(policy, name, value)
                if _layout(fwd()) != want:
                    raise SystemExit(f"T={t} lora={lora} {v}: layout differs from the default")
                ms = time_graph(lambda: fwd(), [], [[]], args.iters)
                cells.append(f"{ms * 1000:7.2f}")
                launches = _launch_times(fwd, 10)
                cells.append("[" + " ".join(f"{x * 1000:.1f}" for x in launches) + "]")
            for name, value in defaults.items():
                setattr(policy, name, value)
            print(f"T={t:>6} lora={lora!s:5} bm={cfg.block_m:>3} us: " + "  ".join(cells),
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
