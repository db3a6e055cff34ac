"""A/B of the LoRA shrink split-K rule (KERNEL_LOG.md v6) in one GPU run: the qwen3 layer
+LoRA with the committed rule, then with split 1 everywhere (v5's shrink), same process.

Usage (GPU): python -m benchmarks.ab_shrink_split [--tokens 1,64,1024,4096] [--iters 30]
"""

from __future__ import annotations

import argparse

from moelora.backends.triton import BACKEND
from moelora.kernels import configs

from .cases import BenchCase
from .floors import measure_ceilings
from .runner import run_case


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,64,256,1024,4096")
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    ceil = measure_ceilings()
    rule = configs._shrink_split
    cache: dict = {}
    print(f"{'T':>6} {'split':>6} {'lora ms':>8} {'split 1':>8} {'ok':>3}")
    for t in (int(v) for v in args.tokens.split(",")):
        case = BenchCase("qwen3-30b-a3b", t)
        configs._shrink_split = rule
        new = run_case(BACKEND, case, ceil, args.iters, cache)["lora"]
        configs._shrink_split = lambda pairs: 1
        old = run_case(BACKEND, case, ceil, args.iters, cache)["lora"]
        configs._shrink_split = rule
        ok = new["ok"] and old["ok"]
        print(f"{t:>6} {rule(t * 8):>6} {new['ms']:8.3f} {old['ms']:8.3f} {'y' if ok else 'N':>3}")


if __name__ == "__main__":
    main()
