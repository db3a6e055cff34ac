"""`LoRAComm`: the protocol of fully sharded LoRA's collectives over the tensor-parallel
group (SPEC.md). A low module (it imports nothing of moelora), so the per-call record, the
backends, the kernels' pipeline and the reference name the type without importing
parallel.py, which implements it (`DistComm`) and sits above them all.

Legend: N rows, R max rank, tp the tensor-parallel size, H hidden.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class LoRAComm(Protocol):
    """Fully sharded LoRA's collectives: gate/up A is split on the rank, down A on I and
    down B on H; every process of the TP group makes the same calls in the same order."""

    hidden_offset: int  # first column of this process's H slice of the down-B output

    def gather_rank(self, u: Tensor) -> Tensor:
        """[N, R/tp] per process -> [N, R], processes in tp_rank order (all-gather, last dim)."""
        ...

    def reduce_rank(self, v: Tensor) -> Tensor:
        """[N, R] partial sums over the I shards -> their sum on every process (all-reduce)."""
        ...
