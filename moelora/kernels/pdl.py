"""Programmatic dependent launch (PDL) for a layer's chain of kernels: `chain_point`, where
a PDL kernel's prologue ends (let the next kernel start, then wait for the one before).

The chain rule the launchers keep, what the decode kernels do before the wait, and where
it was measured: docs/kernels.md ("Decode path"); whether a forward uses PDL is its
plan's (tiling/plan.py). tests/test_pdl.py checks the compiled order.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chain_point(PDL: tl.constexpr):
    """Where a PDL kernel's prologue ends: let the next kernel start, then wait for the one
    before (both no-ops without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
