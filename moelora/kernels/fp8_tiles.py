"""Device helpers of the FP8 (W8A8) kernel paths: e4m3 quantization of input rows with the
reference's fp32 arithmetic (quant/activation_quant.py; kernels/quant_rows.py runs it once
per row before the GEMMs), whole-row activation scales (per-channel format), and the
scaled FP8 step of the GEMMs and decode GEMVs. Pure tile arithmetic; no policy.

Legend: M rows of a tile, G columns of one activation group, BLOCK_K / BLOCK_N a tile's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..device import triton_interpreted
from ..quant.activation_quant import MIN_SCALE as _MIN_SCALE
from ..quantization import FP8_E4M3_MAX as _E4M3_MAX

E4M3_MAX = tl.constexpr(_E4M3_MAX)  # a jit function reads only constexpr globals
MIN_SCALE = tl.constexpr(_MIN_SCALE)
# Triton's interpreter converts fp32 to e4m3 wrongly (3.9: ties round up, and a mantissa
# carry is dropped instead of raising the exponent: 124.6 -> 64), so interpreted kernels
# first round to the e4m3 grid in fp32 (exact, ties to even), which its conversion keeps.
# GPUs convert with cvt.rn.satfinite (round to nearest even) as torch does.
E4M3_BY_GRID = tl.constexpr(triton_interpreted())


@triton.jit
def _e4m3_grid(v):
    """v fp32 with |v| <= 448 -> the nearest e4m3 value (ties to even), in fp32: |v| in
    units of its e4m3 step (2^(e - 3) for an exponent e >= -6, 2^-9 below: the subnormals),
    rounded to an integer by the fp32 add of 2^23 (exact: the step count is below 2^4), with
    v's sign (a negative value rounding to zero gives -0, as the conversion does)."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    steps = tl.abs(v) / step
    r = ((steps + 8388608.0) - 8388608.0) * step
    return tl.where(bits < 0, -r, r)


@triton.jit
def _scale_of(amax):
    """fp32 activation scales max(amax, MIN_SCALE) / 448. Divisions here round to nearest
    (div_rn): Triton's `/` compiles to an approximate division on GPUs (div.full.f32), and
    the quantization must be the reference's bit for bit."""
    return tl.math.div_rn(tl.maximum(amax, MIN_SCALE), tl.zeros_like(amax) + E4M3_MAX)


@triton.jit
def quantize_by(t, scale):
    """t [..., G] quantized to e4m3 with the fp32 scales [..., 1]: (t / scale) clamped to
    +-448, rounded to nearest even (quant/activation_quant.py)."""
    t, scale = tl.broadcast(t.to(tl.float32), scale)
    q = tl.clamp(tl.math.div_rn(t, scale), -E4M3_MAX, E4M3_MAX)
    if E4M3_BY_GRID:
        q = _e4m3_grid(q)
    return q.to(tl.float8e4nv)


@triton.jit
def quantize_rows(t):
    """t [..., G] (each row one activation group of G columns) -> (e4m3 [..., G], fp32
    scales [..., 1]) as quant/activation_quant.py computes them: scale = max(amax,
    MIN_SCALE) / 448, then quantize_by. Masked columns must hold zeros (they leave the
    amax as it is)."""
    t = t.to(tl.float32)
    scale = _scale_of(tl.max(tl.abs(t), axis=-1, keep_dims=True))
    return quantize_by(t, scale), scale


@triton.jit
def row_scales(ptrs, rows_ok, width, stride_k, offs_k):
    """FP8_CHANNEL: the activation scale of whole rows, fp32 [..., 1] = max(amax over the
    `width` columns, MIN_SCALE) / 448, from a pass over them before the K loop: ptrs [...,
    BLOCK_K] the rows' first tile (offs_k its columns), rows_ok the rows to read
    (broadcast against the tile; others give MIN_SCALE / 448)."""
    amax = tl.max(tl.zeros(ptrs.shape, tl.float32), axis=-1, keep_dims=True)
    for k0 in range(0, width, offs_k.shape[0]):
        mask = rows_ok & ((k0 + offs_k) < width)
        t = tl.load(ptrs + k0 * stride_k, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(t), axis=-1, keep_dims=True))
    return _scale_of(amax)


@triton.jit
def block_scaled(
    d, sa, s_ptrs, k0, stride_sk, mask, W_FP8: tl.constexpr, SCALE_K: tl.constexpr,
    SCALE_COLUMNS: tl.constexpr,
):  # fmt: skip
    """A decode GEMV's K step sums d (fp32, the shape of mask) times the input's scales sa
    (stored by quant_rows.py) and its rows' block scales at s_ptrs (W_FP8: e4m3 weights, the
    step one scale block along K); d as is otherwise, and with SCALE_COLUMNS (the scales
    were applied to the input's columns: scaled_columns)."""
    if W_FP8 and not SCALE_COLUMNS:
        d = d * (sa * tl.load(s_ptrs + (k0 // SCALE_K) * stride_sk, mask=mask, other=0.0))
    return d


@triton.jit
def scaled_columns(v, xs_ptrs, stride_xsg, s_ptrs, stride_sk, cols, mask, SCALE_K: tl.constexpr):
    """A decode GEMV's K step whose weight rows share one scale block along N (SCALE_COLUMNS;
    tiling/geometry.py: rows_share_scale_block): v [..., BLOCK_K] (the input's e4m3 values in
    fp32, columns `cols`) times each column's activation-group scale (at xs_ptrs [..., 1],
    stored by quant_rows.py) and the rows' weight block scale of that column's K block (at
    s_ptrs [..., 1]). The step may then span several scale blocks along K: the row sums of
    the weights times this need no scaling after. Masked columns give 0."""
    g = cols // SCALE_K
    sa = tl.load(xs_ptrs + g * stride_xsg, mask=mask, other=0.0)
    return v * (sa * tl.load(s_ptrs + g * stride_sk, mask=mask, other=0.0))


@triton.jit
def fp8_mma(a8, sa, w, acc, s_ptrs, n_mask):
    """acc += (a8 @ w) * (sa sw), vLLM's block-FP8 step: a8 [M, BLOCK_K] e4m3, one
    activation group per row, with its scales sa [M, 1] (quantize_rows); w [BLOCK_K,
    BLOCK_N] an e4m3 tile inside one scale block along K, sw [BLOCK_N] its columns' block
    scales (s_ptrs). The dot runs on the FP8 tensor cores into a fresh fp32 accumulator
    (one K block: its limited-precision accumulation spans one block's products); the
    scales act in fp32."""
    sw = tl.load(s_ptrs, mask=n_mask, other=0.0)
    part = tl.dot(a8, w)
    return acc + part * (sa * sw[None, :])
