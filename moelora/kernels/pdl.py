"""Programmatic dependent launch (PDL) for a layer's chain of kernels.

A kernel launched with PDL may start while the kernel before it in the stream still runs:
its programs begin once every program of that kernel has signalled
(gdc_launch_dependents) or exited. Until its own gdc_wait returns it must not read what
the kernel before it writes, nor write what that kernel reads. The decode kernels use the
time for what depends on nothing in flight: each program loads its first K step of
weight tiles (the layer's real cost at a handful of tokens) into registers, signals its
own dependents, then waits, then runs the rest of its body. So the next kernel's weight
read overlaps this kernel's tail instead of starting after it.

Chain rule (kept by the launchers): the first kernel of a layer is launched normally, so
everything written before the layer (x, top-k ids and weights, slots, `out` for add) is
complete and visible before any kernel of the chain starts; later kernels are launched
with PDL and, before their gdc_wait, read only those inputs and the weights. Every kernel
calls gdc_wait before its first load of a chain intermediate (a no-op when it was not
launched with PDL). tests/test_pdl.py checks the compiled order.

The aligned path's kernels (align's OFFSETS / SCATTER, the LoRA shrink and delta, both
GEMMs, the top-k reduce) take the chain point as their first statement: nothing is read
before the wait, so what overlaps is only the launch and the programs' start behind the
kernel before.

Measured on the H200 (5294ebe, benchmarks/results/h200_5294ebe_ab_pdl_*.log): an L2
prefetch (`prefetch.global.L2` per 128-byte line of the program's weight rows) before the
wait cost +9..13 us at T = 1 with or without PDL launches, so the weights are loaded into
registers instead; PDL launches alone (no early weight loads) took T = 1 with LoRA 0.0420
-> 0.0406 ms and LoRA-free 0.0340 -> 0.0355.

Only on NVIDIA devices of compute capability 9.0 or newer, and never in the interpreter
(it has no griddepcontrol instruction): tiling/plan.py decides, in one place. A program that
returns early still passes the chain point first, so a kernel's completion implies the
completion of the kernel before it.
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
