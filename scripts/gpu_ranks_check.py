"""GPU check of per-slot real ranks (LoRABank.ranks) in the triton backend, bf16, on the
Qwen3-30B-A3B layer: banks whose padded columns [r, R) hold large finite garbage, each
forward (eager and CUDA-graph replay, as the oracle plans it) against the reference on a
clean bank. The CPU tests cover the same paths at tiny shapes under the interpreter; this
runs the compiled kernels at the real shape and tile table.

Banks: mixed ranks (8, 16, 64, 128) in R = 128; 8 rank-8 adapters in R = 128; rank 256;
64 slots of rank 16; 128 slots of ranks 8/16 with every other slot empty (rank 0).
T: 1, 7, 64, 1024, 4096 (the reference on the first 1024 tokens).

Run on a GPU machine from the repository root:  python3 scripts/gpu_ranks_check.py [PIECE ...]
(only the banks whose name contains one of the pieces, e.g. "rank 256"). Prints one line per (bank, T, mode) and exits non-zero if any fails.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from moelora.call import MoECall

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moelora.backends.triton import TritonBackend
from moelora.compare import compare
from moelora.inputs import build_experts, build_inputs
from moelora.presets import resolve_model
from moelora.reference import moe_lora_reference
from moelora.weights import LoRABank, random_lora_bank

GARBAGE = 1e4  # large and finite in bf16 (1e30 overflows a bf16 product to inf)
BANKS = {  # name: (max rank R, real rank of each slot)
    "mixed-8/16/64/128-R128": (128, [8, 16, 64, 128] * 2),
    "8x rank 8 in R128": (128, [8] * 8),
    "rank 256 (8 slots, 256/32)": (256, [256, 32] * 4),
    "64 x rank 16": (16, [16] * 64),
    "128 slots, half empty": (16, [8 if s % 4 else 16 for s in range(128)]),
}
TOKENS = (1, 7, 64, 1024, 4096)
REF_TOKENS = 1024


def dirty(bank: LoRABank) -> LoRABank:
    """The bank with GARBAGE past each slot's real rank, and empty slots (rank 0) for the
    128-slot bank's odd slots."""
    out = LoRABank(*(t.clone() for t in (bank.w13_a, bank.w13_b, bank.w2_a, bank.w2_b)),
                   ranks=bank.ranks.clone(), tile_rank=bank.tile_rank)  # fmt: skip
    for slot, r in enumerate(out.ranks.tolist()):
        for t, dim in ((out.w13_a, 2), (out.w13_b, 3), (out.w2_a, 1), (out.w2_b, 2)):
            t[slot].narrow(dim, r, t.shape[dim + 1] - r).fill_(GARBAGE)
    return out


def main() -> int:
    model = resolve_model("qwen3-30b-a3b")
    shape = model.shape
    experts = build_experts(model, "cuda")
    backend = TritonBackend()
    failed = 0
    pieces = sys.argv[1:]
    for name, (max_rank, ranks) in BANKS.items():
        if pieces and not any(p in name for p in pieces):
            continue
        torch.manual_seed(len(ranks) + max_rank)
        with torch.device("cuda"):
            clean = random_lora_bank(shape, len(ranks), max_rank, ranks=ranks, device="cuda")
        if len(ranks) == 128:
            clean.ranks[1::2] = 0  # empty slots: no lanes, no work
        bank = dirty(clean)
        for tokens in TOKENS:
            x, ids, w, slots = build_inputs(model, tokens, len(ranks), "cuda", seed=tokens)
            slots.copy_(torch.arange(tokens, device="cuda") % (len(ranks) + 1) - 1)
            n = min(tokens, REF_TOKENS)
            ref = moe_lora_reference(x[:n], ids[:n], w[:n], slots[:n], experts, clean, shape)

            def fwd(bank=bank, x=x, ids=ids, w=w, slots=slots):
                return backend.forward(MoECall(x, ids, w, slots, bank), experts, shape)

            for mode in ("eager", "graph"):
                start = time.perf_counter()
                if mode == "eager":
                    out = fwd()
                else:
                    fwd()  # compile outside the capture
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        out = fwd()
                    out.fill_(float("nan"))
                    graph.replay()
                torch.cuda.synchronize()
                cmp = compare(out[:n], ref, shape.dtype)
                failed += not cmp.ok
                ms = (time.perf_counter() - start) * 1e3
                verdict = "ok  " if cmp.ok else "FAIL"
                print(f"{verdict} {name:28s} T={tokens:5d} {mode:5s} {cmp} ({ms:.0f} ms)")
    print(f"{'FAILED' if failed else 'PASSED'}: {failed} failing")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
