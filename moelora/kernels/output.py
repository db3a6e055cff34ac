"""How a kernel writes the layer's output y: the fp32 sum rounded once to y's dtype,
replacing y or, with ADD (AddInputs.ADD), added to what y holds, in fp32."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_y(y_ptrs, acc, mask, ADD: tl.constexpr):
    """y[mask] = acc (fp32 tile), or y + acc with ADD; y_ptrs: the tile's pointers into y."""
    if ADD:
        acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=mask)
