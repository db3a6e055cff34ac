"""What the LoRA terms cost inside the GEMM kernels: per-kernel GPU time (profile_layer's
eager timer, L2 flushed) of one layer under the LoRA row's config, with the adapters'
slots set four ways: no LoRA bank (the LoRA-free kernels at the same tiles), every token
on slot -1 (the LoRA code compiled in, no expand work), every token on slot 0 (one slot
per block), and token t on slot t % 8 (the bench's spread). Then the registers, spills
and shared memory of each compiled GEMM variant.

Usage (GPU): python -m benchmarks.lora_cost [--tokens 4096] [--model qwen3-30b-a3b]
             [--set expand_first=1] [--iters 10]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from moelora.backends.triton import fused_moe_lora
from moelora.call import MoECall
from moelora.inputs import build_inputs
from moelora.kernels import expert_down, expert_up
from moelora.tiling.pick import pick_config

from .ab_knob import parse_set
from .profile_layer import kernel_times
from .tune import load_model

SPREADS = ("no-bank", "all -1", "all 0", "t % 8")


def _slots(spread: str, tokens: int) -> torch.Tensor:
    t = torch.arange(tokens, device="cuda", dtype=torch.int32)
    return {"all -1": t * 0 - 1, "all 0": t * 0, "t % 8": t % 8}.get(spread, t % 8)


def compiled_stats(fn) -> list[str]:
    """One line per compiled variant of a @triton.jit function: registers, spills, shared
    bytes (the attributes differ across Triton versions; what is missing prints '?')."""
    lines = []
    for caches in getattr(fn, "device_caches", {}).values():
        kernels = caches[0] if isinstance(caches, tuple) else caches
        for kernel in kernels.values():
            meta = getattr(kernel, "metadata", None)
            shared = getattr(meta, "shared", "?")
            regs, spills = getattr(kernel, "n_regs", "?"), getattr(kernel, "n_spills", "?")
            lines.append(f"regs {regs} spills {spills} shared {shared}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="4096")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--set", default="", help="knob=value,... on the LoRA row's config")
    args = p.parse_args()
    model, dims, experts, lora = load_model(args.model)
    shape = model.shape
    for tokens in (int(v) for v in args.tokens.split(",")):
        cfg = dataclasses.replace(pick_config(tokens, *dims, lora=True), **parse_set(args.set))
        print(f"T={tokens} cfg {cfg}")
        x, ids, w, _ = build_inputs(model, tokens, 8, "cuda", 0)
        for spread in SPREADS:
            bank = None if spread == "no-bank" else lora
            slots = _slots(spread, tokens)

            def fwd(x, ids, w, slots, bank=bank, cfg=cfg):
                return fused_moe_lora(MoECall(x, ids, w, slots, bank), experts, shape, config=cfg)

            times = kernel_times(fwd, (x, ids, w, slots), args.iters)
            cells = "  ".join(f"{name[:28]} {ms:.4f}" for name, ms in times.items() if ms > 0.002)
            print(f"  {spread:>7}: total {sum(times.values()):.4f}  {cells}", flush=True)
    for name, fn in (
        ("up", expert_up._expert_up_kernel),
        ("down", expert_down._expert_down_kernel),
    ):
        for line in compiled_stats(fn):
            print(f"  {name}: {line}")


if __name__ == "__main__":
    main()
