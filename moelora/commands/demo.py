"""`moelora demo`: an end-to-end run on an embedded preset with random weights and adapters.

A batch whose tokens are spread over several adapters (and the base model, slot -1) goes
through the MoE-LoRA layer; the summary shows what each adapter changed and how the
result compares with the reference.
"""

from __future__ import annotations

import argparse
import time

import torch

from ..compare import compare
from ..presets import resolve_model
from ..reference import moe_lora_reference
from ..routing import route
from ..weights import random_expert_weights, random_lora_bank


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="end-to-end demo on a small preset (CPU when no GPU)")
    p.add_argument("--model", default="tiny", help="preset name or config.json (default: tiny)")
    p.add_argument("--tokens", type=int, default=48, help="tokens in the batch (default 48)")
    p.add_argument("--adapters", type=int, default=4, help="LoRA adapters in slots (default 4)")
    p.add_argument("--rank", type=int, default=8, help="max LoRA rank R (default 8)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: fresh)")
    p.set_defaults(run=run)


def _token_slots(tokens: int, adapters: int, gen: torch.Generator) -> torch.Tensor:
    """Slots -1 .. adapters-1, every one present when the batch is large enough."""
    slots = torch.randint(-1, adapters, (tokens,), generator=gen, dtype=torch.int32)
    head = min(tokens, adapters + 1)
    slots[:head] = torch.arange(-1, adapters, dtype=torch.int32)[:head]
    return slots


def run(args: argparse.Namespace) -> int:
    model = resolve_model(args.model)
    shape = model.shape
    seed = args.seed if args.seed is not None else int(time.time_ns() % 2**31)
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32  # the demo runs the fp32 reference on the CPU
    experts = random_expert_weights(shape, generator=gen, dtype=dtype)
    ranks = [max(1, args.rank >> (a % 3)) for a in range(args.adapters)]  # some below R
    lora = random_lora_bank(
        shape, args.adapters, args.rank, ranks=ranks, generator=gen, dtype=dtype
    )
    x = torch.randn(args.tokens, shape.hidden_size, generator=gen, dtype=dtype)
    logits = torch.randn(args.tokens, shape.num_experts, generator=gen)
    ids, weights = route(logits, model.routing, shape.top_k)
    slots = _token_slots(args.tokens, args.adapters, gen)
    on_input = model.routing.method.weights_on_input

    start = time.perf_counter()
    y = moe_lora_reference(x, ids, weights, slots, experts, lora, shape, weights_on_input=on_input)
    elapsed = time.perf_counter() - start
    base = moe_lora_reference(
        x, ids, weights, None, experts, None, shape, weights_on_input=on_input
    )

    print(f"moelora demo: model {model.name} ({model.model_type}), seed {seed}")
    print(
        f"  E={shape.num_experts} K={shape.top_k} H={shape.hidden_size} "
        f"I={shape.intermediate_size} activation={shape.activation.value} "
        f"routing={model.routing.method.value}"
    )
    print(f"  batch T={args.tokens}, {args.adapters} adapters, ranks {ranks} (R={args.rank})")
    print("  slot  tokens  |y|/|base|  rel. change from base")
    for slot in range(-1, args.adapters):
        rows = slots == slot
        if not rows.any():
            continue
        change = compare(y[rows], base[rows], tol=float("inf")).rel_err
        ratio = (y[rows].norm() / base[rows].norm()).item()
        label = "base" if slot < 0 else str(slot)
        print(f"  {label:>4}  {int(rows.sum()):>6}  {ratio:>10.3f}  {change:>10.3e}")
    exact = torch.equal(y[slots < 0], base[slots < 0])
    print(f"  slot -1 rows equal the base model exactly: {exact}")
    print(f"  reference forward: {elapsed * 1e3:.1f} ms on cpu")
    return 0 if exact and torch.isfinite(y).all() else 1
