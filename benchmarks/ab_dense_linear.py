"""Same-run A/B of a decode step's attention projections: moelora's one-launch GEMM with the
rows' LoRA in its epilogue (kernels/dense_linear.py, its shrink one launch before) against
cuBLAS (F.linear per module) with the per-token LoRA kernel after each (kernels/dense_lora.py),
at Qwen3-30B-A3B's q / k / v (2048 -> 4096 + 512 + 512) and o (4096 -> 2048) shapes, per
batch, LoRA-free and with 8 adapters of rank 16 over the rows. Each side's outputs are
checked against F.linear plus the bank delta first; times are CUDA-graph replays of 20
calls, the order of the two sides alternated, best of 5.

Usage (GPU): python -m benchmarks ab_dense_linear [--batches 1,16,64] [--block-m 32,64]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (2048, (4096, 512, 512)), "o": (4096, (2048,))}
CALLS, REPEATS = 20, 5


def _graph_ms(fn) -> float:
    """ms per call of fn, replayed from one CUDA graph of CALLS calls (best of REPEATS)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    best = float("inf")
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / CALLS)
    return best


def _sides(x, ws, a, bt, slots, lora: bool):
    """(cuBLAS + dense_lora, dense_linear, the reference outputs) for one input."""
    from moelora.kernels import dense_linear as dl
    from moelora.kernels.dense_lora import add_dense_lora
    from moelora.lora.module_banks import dense_lora_delta

    def cublas():
        outs = [F.linear(x, w) for w in ws]
        if lora:
            for o, ak, bk in zip(outs, a, bt):
                add_dense_lora(o, x, slots, ak, bk)
        return outs

    def ours():
        z = dl.lora_shrink(x, slots, a) if lora else None
        return dl.dense_linear(x, ws, [None] * len(ws), slots, z, bt if lora else None)

    want = [F.linear(x, w) for w in ws]
    if lora:
        want = [
            o + dense_lora_delta(x, slots, ak, bk).to(x.dtype) for o, ak, bk in zip(want, a, bt)
        ]
    return cublas, ours, want


def main(argv=None) -> list[dict]:
    from moelora.compare import assert_close
    from moelora.kernels import dense_linear as dl

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--block-m", default=str(dl.BLOCK_M), help="GEMM columns per program")
    args = p.parse_args(argv)
    dtype, dev, slots_n, rank = torch.bfloat16, "cuda", 8, 16
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, (n, widths) in SHAPES.items():
        ws = [torch.randn(m, n, device=dev, generator=g, dtype=dtype) / n**0.5 for m in widths]
        a = [torch.randn(slots_n, rank, n, device=dev, generator=g, dtype=dtype) / n**0.5
             for _ in widths]  # fmt: skip
        bt = [torch.randn(slots_n, rank, m, device=dev, generator=g, dtype=dtype) / rank**0.5
              for m in widths]  # fmt: skip
        for batch in (int(b) for b in args.batches.split(",")):
            x = torch.randn(batch, n, device=dev, generator=g, dtype=dtype)
            for lora in (False, True):
                slots = torch.arange(batch, device=dev, dtype=torch.int32) % slots_n
                if not lora:
                    slots = torch.full_like(slots, -1)
                cublas, ours, want = _sides(x, ws, a, bt, slots, lora)
                for side in (cublas, ours):
                    for got, ref in zip(side(), want):
                        assert_close(got, ref, dtype, what=f"{side.__name__} {name} {batch}")
                times = {"cublas": [], "ours": {}}
                for k, block_m in enumerate(int(v) for v in args.block_m.split(",")):
                    dl.BLOCK_M = block_m
                    for side in [cublas, ours] if k % 2 == 0 else [ours, cublas]:
                        ms = _graph_ms(side)
                        if side is cublas:
                            times["cublas"].append(ms)
                        else:
                            times["ours"][block_m] = ms
                row = dict(shape=name, batch=batch, lora=lora, cublas_ms=min(times["cublas"]),
                           ours_ms=times["ours"])  # fmt: skip
                rows.append(row)
                ours_s = " ".join(
                    f"BLOCK_M {k}: {v * 1e3:.1f} us" for k, v in row["ours_ms"].items()
                )
                print(f"{name:4s} batch {batch:3d} {'8 adapters' if lora else 'LoRA-free '}: "
                      f"cuBLAS + dense_lora {row['cublas_ms'] * 1e3:.1f} us; dense_linear {ours_s}",
                      flush=True)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
