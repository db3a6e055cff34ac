"""Ceilings measured on this GPU and the floor of a MoE + LoRA layer (anchors.md section 7).

floor = max(bytes / measured copy bandwidth, FLOPs / measured bf16 matmul rate), with the
bytes and FLOPs counted from the actual routing (experts hit, (slot, expert) pairs hit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class Ceilings:
    bandwidth: float  # bytes/s, device-to-device copy, read + write counted
    matmul: float  # FLOP/s, bf16 8192^3


def _median_ms(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def measure_ceilings() -> Ceilings:
    n = 1 << 29  # 1 GiB of bf16: far beyond L2 (50 MB)
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 2 / (_median_ms(lambda: dst.copy_(src)) / 1e3)
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    rate = 2 * m**3 / (_median_ms(lambda: a @ b) / 1e3)
    return Ceilings(bw, rate)


@dataclass(frozen=True)
class Work:
    bytes: float
    flops: float

    def floor_s(self, c: Ceilings) -> float:
        return max(self.bytes / c.bandwidth, self.flops / c.matmul)


def layer_work(
    topk_ids,
    token_slots,
    hidden: int,
    inter: int,
    parts: int,
    rank: int | Sequence[int],
    elem: int = 2,
    lora: bool = True,
    weight_bytes: float | None = None,
) -> Work:
    """Fewest bytes and FLOPs of one layer: each hit expert's weights (and each hit
    (slot, expert) adapter, at its slot's real rank) read once, x read once, y written once.

    topk_ids [T, K]; token_slots [T] (-1 = no adapter) or None; rank: every slot's real
    rank, or one per slot [L] (a mixed bank; padding up to the bank's R is not work).
    weight_bytes: bytes per expert weight element (FP8: 1 plus its share of the scales);
    None: elem."""
    tokens, top_k = topk_ids.shape
    e_hit = torch.unique(topk_ids).numel()
    per_expert = (parts + 1) * hidden * inter
    per_weight = elem if weight_bytes is None else weight_bytes
    nbytes = per_weight * per_expert * e_hit + elem * 2 * tokens * hidden
    flops = 2.0 * tokens * top_k * per_expert
    if lora and token_slots is not None:
        active = (token_slots >= 0).repeat_interleave(top_k)
        slots = token_slots.long().repeat_interleave(top_k)[active]
        keys = slots * 1_000_003 + topk_ids.reshape(-1).long()[active]
        pair_slots = torch.unique(keys) // 1_000_003
        per_rank = parts * hidden + parts * inter + inter + hidden  # A and B elements per rank
        nbytes += elem * per_rank * int(_ranks_of(rank, pair_slots).sum())
        flops += 2.0 * per_rank * int(_ranks_of(rank, slots).sum())
    return Work(float(nbytes), flops)


def _ranks_of(rank: int | Sequence[int], slots: torch.Tensor) -> torch.Tensor:
    """The real rank of each entry of `slots` (int64)."""
    if isinstance(rank, int):
        return torch.full_like(slots, rank)
    table = torch.as_tensor(list(rank), dtype=torch.long, device=slots.device)
    if slots.numel() and int(slots.max()) >= table.numel():
        raise ConfigError(
            "rank",
            list(rank),
            f"one real rank per slot: token_slots name slot {int(slots.max())}",
            f"pass at least {int(slots.max()) + 1} ranks (the bank's slot count)",
        )
    return table[slots]
