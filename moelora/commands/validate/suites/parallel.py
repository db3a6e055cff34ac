"""`moelora validate --suite parallel`: moelora.parallel across two processes, TP, EP and
fully sharded LoRA, each layout's output against the single-process reference on the full
weights (layouts.py runs one).

Cases: every layout of CASES with the backend of --backends in the serving dtype (bf16 on a
GPU) and with the reference backend in fp32 (which checks the sharding alone). On GPUs: NCCL,
one GPU per process (needs 2). On a CPU: gloo, two processes, fp32 at small shapes (the
backend through Triton's interpreter).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Iterator

import torch

from ....activations import Activation
from ....config import ParallelConfig
from ....errors import ConfigError
from ....routing import RoutingConfig, RoutingMethod
from .layouts import Layout, Sizes, layout_run
from .suite import CheckSuite, Verdict

WORLD = 2  # every case is a layout of two processes
SILU_ROUTING = RoutingConfig(RoutingMethod.SOFTMAX_TOPK, renormalize=True)
SWIGLU_ROUTING = RoutingConfig(RoutingMethod.TOPK_SOFTMAX)
# (id, tp, ep, fully sharded, activation, bias, routing)
CASES = [
    ("tp2-silu", 2, 1, False, Activation.SILU, False, SILU_ROUTING),
    ("tp2-swigluoai-bias", 2, 1, False, Activation.SWIGLUOAI, True, SWIGLU_ROUTING),
    ("ep2-silu", 1, 2, False, Activation.SILU, False, SILU_ROUTING),
    ("fs-tp2-silu", 2, 1, True, Activation.SILU, False, SILU_ROUTING),
    ("fs-tp2-relu2", 2, 1, True, Activation.RELU2_NO_MUL, False, SILU_ROUTING),
    ("fs-tp2-swigluoai-bias", 2, 1, True, Activation.SWIGLUOAI, True, SWIGLU_ROUTING),
]


GPU_SIZES = Sizes(96, 16, 4, 512, 256, 16, 4)
CPU_SIZES = Sizes(16, 8, 2, 64, 32, 8, 4)  # the interpreter: seconds


def layouts(backend: str, dtype: torch.dtype) -> list[Layout]:
    return [
        Layout(cid, ParallelConfig(tp, ep, fully), act, bias, routing, backend, dtype)
        for cid, tp, ep, fully, act, bias, routing in CASES
    ]


def _worker(rank: int, device: str, init_file: str, runs: list, sizes: Sizes, seed: int,
            result_file: str) -> None:  # fmt: skip
    """One process of the world: every layout of `runs`; rank 0 saves (layout, Comparison)."""
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)  # fmt: skip
    try:
        rows = [(lay, layout_run(lay, sizes, device, seed + i)) for i, lay in enumerate(runs)]
        if rank == 0:
            torch.save([(lay.label, res.rel_err, res.tol, res.ok) for lay, res in rows],
                       result_file)  # fmt: skip
        dist.barrier()  # every rank done before any tears the group down
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, device: str, backend: str) -> Iterator[Verdict]:
    import torch.multiprocessing as mp

    sizes = GPU_SIZES if device == "cuda" else CPU_SIZES
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    runs = layouts(backend, dtype) + layouts("reference", torch.float32)
    seed = args.seed
    print(f"  {WORLD} processes ({'NCCL' if device == 'cuda' else 'gloo'}), seed {seed}, "
          f"T={sizes.tokens} E={sizes.experts} K={sizes.top_k} H={sizes.hidden} "
          f"I={sizes.inter} R={sizes.rank} L={sizes.slots}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        init, result = os.path.join(tmp, "init"), os.path.join(tmp, "rows.pt")
        mp.spawn(_worker, args=(device, init, runs, sizes, seed, result), nprocs=WORLD)
        rows = torch.load(result)
    for label, rel_err, tol, ok in rows:
        yield Verdict.of(label, ok, f"rel_err {rel_err:.2e} (tol {tol:.0e}) against the "
                         "single-process reference")  # fmt: skip


def check_gpus(args: argparse.Namespace, device: str) -> None:
    found = torch.cuda.device_count() if device == "cuda" else WORLD
    if found < WORLD:
        raise ConfigError("--suite", "parallel", f"{WORLD} GPUs (one per process; found "
                          f"{found})", "run it on a machine with 2 GPUs, or --device cpu "
                          "(gloo, small shapes)")  # fmt: skip


SUITE = CheckSuite(
    name="parallel",
    summary="TP, EP and fully sharded LoRA across two processes (NCCL, 2 GPUs; --device cpu: "
    "gloo), each layout against the single-process reference",
    cpu_refusal=None,
    run=run,
    check_args=check_gpus,
)
