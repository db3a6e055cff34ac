"""What a read of N bytes costs on this GPU as one short kernel: the practical bandwidth
floor of a decode layer (T = 1 streams ~50 MB in the up GEMM and ~25 MB in the down GEMM,
20-30 us kernels, where launch ramp and tail count; the bench's floor uses the copy
bandwidth of a 1 GB transfer). Each size: one Triton kernel summing a bf16 buffer of that
size (each program reads BLOCK elements per step over its chunk), under CUDA-graph replay
with L2 flushed, median of --iters; also two back-to-back kernels of half the size each
(the two GEMMs of a layer).

Usage (GPU): python -m benchmarks.read_floor [--mb 25,50,75,150,300,1200] [--iters 50]
       [--per-sm 4,16] [--blocks 4096] [--warps 8]   (each combination is timed)
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from moelora.bench.runner import time_graph


@triton.jit
def _read_kernel(src_ptr, dst_ptr, n, chunk, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * chunk
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, chunk, BLOCK):
        idx = start + k + offs
        acc += tl.load(src_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    tl.store(dst_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def read(
    buf: torch.Tensor, out: torch.Tensor, programs: int, block: int = 4096, warps: int = 8
) -> None:
    chunk = triton.cdiv(triton.cdiv(buf.numel(), programs), block) * block
    _read_kernel[(programs,)](buf, out, buf.numel(), chunk, BLOCK=block, num_warps=warps)


def _time(
    mb: float, programs: int, iters: int, block: int = 4096, warps: int = 8
) -> tuple[float, float]:
    """(one kernel ms, two half-size kernels ms) for a read of mb megabytes."""
    n = int(mb * 1e6) // 2
    buf = torch.randn(n, device="cuda").to(torch.bfloat16)
    half_a, half_b = buf[: n // 2], buf[n // 2 :]
    out = torch.empty(programs, device="cuda")
    one = time_graph(lambda b: read(b, out, programs, block, warps), (buf,), [(buf,)], iters)
    two = time_graph(
        lambda a, b: (read(a, out, programs, block, warps), read(b, out, programs, block, warps)),
        (half_a, half_b),
        [(half_a, half_b)],
        iters,
    )
    return one, two


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", default="25,50,75,150,300,1200")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--per-sm", default="4,16", help="programs per SM to try")
    p.add_argument("--blocks", default="4096", help="elements per program step to try")
    p.add_argument("--warps", default="8", help="num_warps values to try")
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(
        f"{'MB':>6} {'programs':>8} {'block':>6} {'warps':>5} {'one kernel us':>14} {'TB/s':>6} "
        f"{'two halves us':>14} {'TB/s':>6}"
    )
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    for mb in (float(v) for v in args.mb.split(",")):
        best = None
        for per_sm in ints(args.per_sm):
            for block in ints(args.blocks):
                for warps in ints(args.warps):
                    one, two = _time(mb, sms * per_sm, args.iters, block, warps)
                    best = min(best or one, one)
                    print(
                        f"{mb:>6.0f} {sms * per_sm:>8} {block:>6} {warps:>5} {one * 1e3:>14.1f} "
                        f"{mb / one / 1e3:>6.2f} {two * 1e3:>14.1f} {mb / two / 1e3:>6.2f}",
                        flush=True,
                    )
        print(f"{mb:>6.0f} MB best one-kernel read: {best * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    main()
