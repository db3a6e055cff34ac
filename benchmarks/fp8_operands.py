"""The e4m3 (W8A8) operands and variants of benchmarks/gemm_ceiling.py --fp8: the bf16
operands quantized with moelora's own helpers BEFORE timing, the torch calls that multiply
them, and each call's expected output (fp32 GEMMs of the dequantized operands).

Layouts (what the torch ops require; torch._scaled_grouped_mm / _scaled_mm take the second
operand column-major in its last two dims, i.e. a transposed view of a row-major [.., N, K]):
  fp8 grouped:     rows_q [P, H] row-major, scale [P] fp32; w13 [E, N, H].transpose(1, 2)
                   -> [E, H, N] column-major, scale [E, N] fp32; offs [E] int32; out bf16.
  fp8 dense:       rows_q [P, H], scale_a [P, 1]; expert 0's w13[0].t() -> [H, N]
                   column-major, scale_b [1, N]; out bf16.
  fp8 dense block: rows_q [P, H], scale_a [P, H/128] column-major (stride [1, P]); expert 0's
                   w13[0].t(), its 128x128 scales [N/128, H/128] zero-padded along the K blocks
                   to a multiple of 4 and transposed -> [L4, N/128] (stride [1, L4]), as cuBLAS
                   wants them.
The down GEMM is the same with z [P, I] and w2 [E, H, I].

Legend: P pairs, E experts, H hidden, I intermediate, N = S * I, L4 = K/128 rounded up to 4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.ceiling_operands import Operands, Variant
from moelora.quant.activation_quant import quantize_activations
from moelora.quant.fp8_experts import FP8ExpertWeights, dequantize, quantize_experts
from moelora.quantization import QuantConfig, Quantization
from moelora.weights import ExpertWeights

BLOCK = 128  # moelora's FP8_BLOCK side (formats.DEFAULT_BLOCK), the only block cuBLAS takes
CHECK_ROWS = 2048  # rows checked against the fp32 reference: enough to catch a wrong layout


@dataclass(frozen=True)
class QuantizedRows:
    """One GEMM input in e4m3: q [P, K] and fp32 scales [P, G] (G = 1 rowwise, K/128 grouped)."""

    q: Tensor
    scale: Tensor

    def dequantized(self) -> Tensor:
        """fp32 [P, K]: q times its row's (or group's) scale."""
        k = self.q.shape[1]
        width = k if self.scale.shape[1] == 1 else BLOCK  # a partial last group: cut at K
        return self.q.float() * self.scale.repeat_interleave(width, dim=1)[:, :k]


@dataclass(frozen=True)
class FP8Operands:
    """rows / z per row (rowwise) and per 128 columns (block); the experts per output column
    (FP8_CHANNEL, all E) and in 128x128 blocks (FP8_BLOCK, expert 0 only: the dense GEMM's)."""

    rows: QuantizedRows
    z: QuantizedRows
    rows_block: QuantizedRows
    z_block: QuantizedRows
    channel: FP8ExpertWeights
    block: FP8ExpertWeights


def quantize_operands(ops: Operands) -> FP8Operands:
    """Everything --fp8 multiplies, quantized once before timing."""
    first = ExpertWeights(ops.experts.w13[:1], ops.experts.w2[:1])
    return FP8Operands(
        rows=QuantizedRows(*quantize_activations(ops.rows, None)),
        z=QuantizedRows(*quantize_activations(ops.z, None)),
        rows_block=QuantizedRows(*quantize_activations(ops.rows, BLOCK)),
        z_block=QuantizedRows(*quantize_activations(ops.z, BLOCK)),
        channel=quantize_experts(ops.experts, QuantConfig(Quantization.FP8_CHANNEL)),
        block=quantize_experts(first, QuantConfig(Quantization.FP8_BLOCK, (BLOCK, BLOCK))),
    )


def _checked_rows(pairs: int) -> Tensor:
    return torch.arange(0, pairs, max(1, pairs // CHECK_ROWS))


def _grouped_ref(a: QuantizedRows, w: Tensor, scale: Tensor, quant: QuantConfig, offs: Tensor):
    """A lazy (row ids [R], fp32 [R, N]): each checked row times its expert's dequantized
    weight w [E, N, K], the expert found from offs [E]."""

    def ref() -> tuple[Tensor, Tensor]:
        ids = _checked_rows(a.q.shape[0]).to(a.q.device)
        expert = torch.searchsorted(offs.long(), ids, right=True)
        rows = QuantizedRows(a.q[ids], a.scale[ids]).dequantized()
        out = torch.empty(len(ids), w.shape[1], device=a.q.device)
        for e in expert.unique().tolist():
            sel = expert == e
            deq = dequantize(quant, w[e : e + 1], scale[e : e + 1])[0]
            out[sel] = rows[sel] @ deq.T
        return ids, out

    return ref


def _dense_ref(a: QuantizedRows, w: FP8ExpertWeights, up: bool):
    """A lazy (row ids [R], fp32 [R, N]): the checked rows times expert 0's dequantized weight."""

    def ref() -> tuple[Tensor, Tensor]:
        ids = _checked_rows(a.q.shape[0]).to(a.q.device)
        weight, scale = _weight(w, up)
        deq = dequantize(w.quant, weight[:1], scale[:1])[0]
        return ids, QuantizedRows(a.q[ids], a.scale[ids]).dequantized() @ deq.T

    return ref


def _grouped_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, offs: Tensor) -> Tensor:
    """CUTLASS rowwise grouped GEMM: a [P, K] e4m3, b [E, K, N] column-major, offs [E] int32."""
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)


def _dense_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor) -> Tensor:
    """cuBLAS rowwise GEMM: a [P, K] e4m3, b [K, N] column-major, scales [P, 1] and [1, N]."""
    return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)


def _block_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor) -> Tensor:
    """cuBLAS 1x128 x 128x128 block-scaled GEMM; raises AttributeError where this torch lacks
    torch.nn.functional.scaled_mm / its ScalingType (the variant then shows as unavailable)."""
    recipe = F.ScalingType
    return F.scaled_mm(
        a, b, scale_a, recipe.BlockWise1x128, scale_b, recipe.BlockWise128x128,
        output_dtype=torch.bfloat16,
    )  # fmt: skip


def _block_weight_scale(scale: Tensor) -> Tensor:
    """[N/128, K/128] -> [L4, N/128] with strides [1, L4]: K blocks zero-padded to a multiple
    of 4 (cuBLAS reads them in fours), then transposed."""
    return F.pad(scale, (0, -scale.shape[1] % 4)).t()


def _side(q: FP8Operands, ops: Operands, up: bool, block: bool = False):
    """(input rows, weights, flops) of the up (rows x w13) or the down (z x w2) GEMM."""
    a = (q.rows_block if up else q.z_block) if block else (q.rows if up else q.z)
    return a, q.block if block else q.channel, ops.flops_up if up else ops.flops_down


def _weight(w: FP8ExpertWeights, up: bool) -> tuple[Tensor, Tensor]:
    return (w.w13, w.w13_scale) if up else (w.w2, w.w2_scale)


# Every tensor a call reads is in its static tuple (none in the closure), so a test can run
# the same call on meta tensors of the same strides: torch's own layout checks, no GPU.
def _grouped(q: FP8Operands, ops: Operands, up: bool) -> Variant:
    a, w, flops = _side(q, ops, up)
    weight, scale = _weight(w, up)
    static = (a.q, weight.transpose(1, 2), a.scale.reshape(-1), scale, ops.offs)
    return Variant(_grouped_mm, static, flops, _grouped_ref(a, weight, scale, w.quant, ops.offs))


def _dense(q: FP8Operands, ops: Operands, up: bool) -> Variant:
    a, w, flops = _side(q, ops, up)
    weight, scale = _weight(w, up)
    static = (a.q, weight[0].t(), a.scale, scale[0].reshape(1, -1))
    return Variant(_dense_mm, static, flops, _dense_ref(a, w, up))


def _dense_block(q: FP8Operands, ops: Operands, up: bool) -> Variant:
    a, w, flops = _side(q, ops, up, block=True)
    weight, scale = _weight(w, up)
    scale_a = a.scale.t().contiguous().t()  # [P, K/128], strides [1, P]
    static = (a.q, weight[0].t(), scale_a, _block_weight_scale(scale[0]))
    return Variant(_block_mm, static, flops, _dense_ref(a, w, up))


def _both(up: Variant, down: Variant) -> Variant:
    n = len(up.static)
    return Variant(
        lambda *t: (up.fn(*t[:n]), down.fn(*t[n:])), up.static + down.static, up.flops + down.flops
    )


def fp8_variants(ops: Operands, q: FP8Operands) -> dict[str, Variant]:
    """The --fp8 rows of the ceiling, named as printed; FLOPs as the bf16 rows'."""
    up, down = _grouped(q, ops, True), _grouped(q, ops, False)
    return {
        "fp8 grouped up": up,
        "fp8 grouped down": down,
        "fp8 grouped both": _both(up, down),
        "fp8 dense up": _dense(q, ops, True),
        "fp8 dense down": _dense(q, ops, False),
        "fp8 dense block up": _dense_block(q, ops, True),
        "fp8 dense block down": _dense_block(q, ops, False),
    }
