"""How a kernel writes what it computed: the layer's output y (the fp32 sum rounded once to
y's dtype, replacing y or, with ADD (AddInputs.ADD), added to what y holds, in fp32), and
an fp32 tile in a stored dtype rounded as a GPU rounds it."""

from __future__ import annotations

import triton
import triton.language as tl

from ..device import triton_interpreted

# Triton's interpreter truncates fp32 -> bf16 where a GPU's cvt rounds to nearest even
# (ENVIRONMENT.md): interpreted kernels round the bits first, which its cast then keeps. It
# matters where a stored tile is read again through a rounding of its own: FP8 experts
# quantize the stored z to e4m3, where a truncated bf16 ulp moves a group's amax and with it
# every e4m3 rounding of the group.
BF16_BY_BITS = tl.constexpr(triton_interpreted())


@triton.jit
def as_stored(t, dtype: tl.constexpr):
    """t (fp32) converted to `dtype`, rounded to nearest even (ties to even) as on a GPU."""
    if BF16_BY_BITS:
        if dtype == tl.bfloat16:
            bits = t.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            t = bits.to(tl.float32, bitcast=True)
    return t.to(dtype)


@triton.jit
def store_y(y_ptrs, acc, mask, ADD: tl.constexpr):
    """y[mask] = acc (fp32 tile), or y + acc with ADD; y_ptrs: the tile's pointers into y."""
    if ADD:
        acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, as_stored(acc, y_ptrs.dtype.element_ty), mask=mask)
