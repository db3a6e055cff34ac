"""Programmatic dependent launch (PDL) for a layer's chain of kernels, and the L2 prefetch
that makes the overlap pay.

A kernel launched with PDL may start while the kernel before it in the stream still runs:
its programs begin once every program of that kernel has signalled
(gdc_launch_dependents) or exited. Until its own gdc_wait returns it must not read what
the kernel before it writes, nor write what that kernel reads. The decode kernels use the
time for what depends on nothing in flight: each program asks L2 for the weight rows it
will stream (the layer's real cost at a handful of tokens), signals its own dependents,
then waits, then runs its unchanged body, whose weight loads now hit L2. So the next
kernel's weight read overlaps this kernel's tail instead of starting after it.

Chain rule (kept by the launchers): the first kernel of a layer is launched normally, so
everything written before the layer (x, top-k ids and weights, slots, `out` for add) is
complete and visible before any kernel of the chain starts; later kernels are launched
with PDL and, before their gdc_wait, read only those inputs and the weights. Every kernel
still calls gdc_wait before its first load of a chain intermediate (safe, and a no-op,
when it was not launched with PDL).

Only on CUDA devices of compute capability 9.0 or newer, and never in the interpreter
(it has no griddepcontrol or prefetch instruction): `pdl_active` decides, in one place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import interpreted

LINE_BYTES = 128  # one L2 prefetch request covers a 128-byte line


def pdl_active(requested: bool, device: torch.device) -> bool:
    """Whether a launcher asked for PDL (TileConfig.pdl) may use it on this device."""
    if not requested or interpreted() or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def line_elems(t: torch.Tensor) -> int:
    """Elements of t per 128-byte line (the prefetch helper's LINE)."""
    return LINE_BYTES // t.element_size()


def prefetch_lines(length: int, line: int, rows: int) -> int:
    """LINES for prefetch_rows: lines of a row per step, at most what covers `length`
    elements and at most 256 requests per step over the `rows` rows."""
    return max(1, min(triton.next_power_of_2(triton.cdiv(length, line)), max(1, 256 // rows)))


@triton.jit
def l2_prefetch(base_ptr, offs, mask):
    """Ask L2 for the lines holding base_ptr + offs where mask (masked-off entries ask for
    base_ptr's line). A hint: no value comes back, nothing waits for it."""
    ptrs = base_ptr + tl.where(mask, offs, 0)
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def prefetch_rows(base_ptr, row_offs, row_mask, length, LINE: tl.constexpr, LINES: tl.constexpr):
    """L2 prefetch of `length` contiguous elements from each row start base_ptr + row_offs
    [N] (where row_mask): one request per LINE elements, LINES lines of every row per step."""
    offs_l = tl.arange(0, LINES) * LINE
    for k0 in range(0, length, LINES * LINE):
        k = k0 + offs_l
        l2_prefetch(
            base_ptr, row_offs[:, None] + k[None, :], row_mask[:, None] & (k < length)[None, :]
        )


@triton.jit
def chain_point(PDL: tl.constexpr):
    """Where a PDL kernel's prologue ends: let the next kernel start, then wait for the one
    before (both no-ops without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
