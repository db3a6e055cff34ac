"""The backend registry: name -> Backend, in ranking order (fastest first).

The order is the auto ranking the oracle walks. Why this order: the fused Triton kernels
read each expert's weights once per token block and fuse the LoRA deltas into the two
GEMMs; `torch._grouped_mm` runs the base GEMMs well on Hopper (549 TFLOP/s for Qwen3
prefill measured on an H200, shared/research/anchors.md) but its LoRA path is separate
torch ops; the reference is a Python loop. benchmarks/ re-measures this order per preset;
change it here, and only here, when they disagree.

Explicit imports in a fixed order: a backend module that is missing or fails to import is
an error here, never a silently smaller registry.
"""

from __future__ import annotations

from . import grouped_mm, reference, triton
from .base import Backend

REGISTRY: dict[str, Backend] = {
    backend.name: backend for backend in (triton.BACKEND, grouped_mm.BACKEND, reference.BACKEND)
}
RANKING = tuple(REGISTRY)
