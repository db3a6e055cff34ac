"""The backend registry: name -> Backend, in ranking order (fastest first).

The order is the auto ranking the oracle walks. Why this order: the fused Triton kernels
read each expert's weights once per token block and fuse the LoRA deltas into the two
GEMMs; `torch._grouped_mm` runs the base GEMMs well on Hopper (549 TFLOP/s for Qwen3
prefill measured on an H200, shared/research/anchors.md) but its LoRA path is separate
torch ops; the reference is a Python loop. benchmarks/ re-measures this order per preset;
change it here, and only here, when they disagree.

A module missing from the tree is simply not registered yet; any other import error
(a module that exists but fails, or a package it needs) is raised, never hidden.
"""

from __future__ import annotations

import importlib

from .base import Backend

RANKING = ("triton", "grouped_mm", "reference")


def _load(module_name: str) -> Backend | None:
    qualified = f"{__package__}.{module_name}"
    try:
        module = importlib.import_module(qualified)
    except ModuleNotFoundError as err:
        if err.name != qualified:
            raise
        return None
    return module.BACKEND


REGISTRY: dict[str, Backend] = {}
for _name in RANKING:
    _backend = _load(_name)
    if _backend is not None:
        REGISTRY[_backend.name] = _backend
