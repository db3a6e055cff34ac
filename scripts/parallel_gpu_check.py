"""Multi-GPU check of moelora.parallel over NCCL: TP, EP and fully sharded LoRA on real GPUs,
each layout's output compared with the single-process fp32 reference on the full weights.

Run on a machine with >= 2 GPUs from the repository root:
    python3 scripts/parallel_gpu_check.py [--world 2]
Prints one row per (backend, case) and exits non-zero if any fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moelora import (
    Activation,
    LoRAConfig,
    MoEShape,
    ParallelConfig,
    RoutingConfig,
    RoutingMethod,
    moe_lora_reference,
    random_expert_weights,
    random_lora_bank,
    route,
)
from moelora.compare import compare
from moelora.deployment import Deployment
from moelora.device import probe
from moelora.layer import to_device
from moelora.parallel import ParallelMoELoRALayer

SWIGLU = (Activation.SWIGLUOAI, True, RoutingConfig(RoutingMethod.TOPK_SOFTMAX))
SILU = (Activation.SILU, False, RoutingConfig(RoutingMethod.SOFTMAX_TOPK, renormalize=True))
RELU2 = (Activation.RELU2_NO_MUL, False, SILU[2])
# (id, tp, ep, fully sharded, (activation, bias, routing)) for a world of 2 ranks
CASES = [
    ("tp2-silu", 2, 1, False, SILU),
    ("tp2-swigluoai-bias", 2, 1, False, SWIGLU),
    ("ep2-silu", 1, 2, False, SILU),
    ("fs-tp2-silu", 2, 1, True, SILU),
    ("fs-tp2-relu2", 2, 1, True, RELU2),
    ("fs-tp2-swigluoai-bias", 2, 1, True, SWIGLU),
]
TOKENS, E, K, H, INTER, R, L = 96, 16, 4, 512, 256, 16, 4


def _case(rank: int, case, backend: str, dtype: torch.dtype, seed: int) -> tuple[float, float]:
    cid, tp, ep, fully, (act, bias, routing) = case
    shape = MoEShape(E, K, H, INTER, act, has_bias=bias, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)  # identical inputs on every rank
    experts = random_expert_weights(shape, generator=gen, dtype=torch.float32)
    bank = random_lora_bank(
        shape, L, R, ranks=[R, R // 2, R, 4], generator=gen, dtype=torch.float32
    )
    x = torch.randn(TOKENS, H, generator=gen)
    ids, wts = route(torch.randn(TOKENS, E, generator=gen), routing, K)
    slots = torch.randint(-1, L, (TOKENS,), generator=gen, dtype=torch.int32)
    dev = torch.device("cuda", torch.cuda.current_device())
    experts = to_device(experts, dev, dtype)
    bank = dataclasses.replace(
        bank, **{f: getattr(bank, f).to(dev, dtype) for f in ("w13_a", "w13_b", "w2_a", "w2_b")}
    )
    x, ids, wts, slots = x.to(dev, dtype), ids.to(dev), wts.to(dev), slots.to(dev)
    deployment = Deployment(
        shape=shape,
        routing=routing,
        device=probe(),
        parallel=ParallelConfig(tp, ep, fully),
        lora=LoRAConfig(enabled=True, max_rank=R, num_slots=L),
        backend=backend,
        name=cid,
    )
    layer = ParallelMoELoRALayer(deployment, experts)
    out = layer(x, ids, wts, slots, layer.shard_bank(bank))
    ref = moe_lora_reference(
        x, ids, wts, slots, experts, bank, shape, weights_on_input=routing.method.weights_on_input
    )
    result = compare(out, ref, dtype)
    return result.rel_err, result.tol


def worker(rank: int, world: int, port: int, seed: int, failures) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        for backend, dtype in (("triton", torch.bfloat16), ("reference", torch.float32)):
            for i, case in enumerate(CASES):
                err, tol = _case(rank, case, backend, dtype, seed + i)
                if rank == 0:
                    ok = err <= tol
                    print(
                        f"{backend:<10} {case[0]:<24} {str(dtype)[6:]:<9} rel_err={err:.2e} "
                        f"tol={tol:.0e} {'pass' if ok else 'FAIL'}",
                        flush=True,
                    )
                    if not ok:
                        failures.value += 1
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    if torch.cuda.device_count() < args.world:
        print(f"needs {args.world} GPUs, found {torch.cuda.device_count()}")
        return 2
    failures = mp.get_context("spawn").Value("i", 0)
    seed = random.randrange(2**30)
    print(
        f"NCCL, {args.world} x {torch.cuda.get_device_name(0)}, seed {seed}, "
        f"T={TOKENS} E={E} K={K} H={H} I={INTER} R={R} L={L}",
        flush=True,
    )
    mp.spawn(worker, args=(args.world, 29517, seed, failures), nprocs=args.world, join=True)
    print(f"parallel: {len(CASES) * 2 - failures.value}/{len(CASES) * 2} passed")
    return 1 if failures.value else 0


if __name__ == "__main__":
    sys.exit(main())
