"""`FP8ExpertWeights`: e4m3 base experts with their fp32 scales, checked whole on
construction (nothing is kept half-checked), dequantized for the reference, and
`quantize_experts` to build one from full-precision weights (tests, validate, bench).

Legend: E experts, H hidden, I intermediate, S = 2 gated / 1 non-gated, N a GEMM's
output rows (S*I for w13, H for w2), K its input width (H for w13, I for w2),
bn x bk the scale block.
Scales (`weight_scale_inv` in checkpoints: dequantized = fp8 * scale):
  FP8_BLOCK   w13_scale [E, ceil(S*I / bn), ceil(H / bk)], w2_scale [E, ceil(H / bn), ceil(I / bk)]
  FP8_CHANNEL w13_scale [E, S*I], w2_scale [E, H] ([E] or [E, N, 1] accepted and broadcast)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import WeightsError
from ..quantization import FP8_E4M3_MAX, QuantConfig, Quantization
from ..weights import ExpertWeights

IN_MEMORY = "in memory"
_FIX_RESAVE = "re-export the checkpoint with its scales (or quantize the bf16 one again)"


def scale_shape(quant: QuantConfig, experts: int, rows: int, cols: int) -> tuple[int, ...]:
    """The scale tensor's shape for a weight [E, N = rows, K = cols] in this format."""
    if quant.method is Quantization.FP8_BLOCK:
        bn, bk = quant.block
        return (experts, -(-rows // bn), -(-cols // bk))
    return (experts, rows)


def checked_fp8_pair(
    quant: QuantConfig, file: str, key: str, weight: Tensor, scale_key: str, scale: Tensor | None
) -> Tensor:
    """Check one e4m3 weight [E, N, K] and its scale; returns the scale as fp32 in its
    canonical shape (scale_shape). Raises WeightsError naming file, key, found, expected."""
    if weight.dtype != torch.float8_e4m3fn:
        fix = "re-quantize the experts to e4m3" if weight.dtype.is_floating_point else ""
        raise WeightsError(file, key, f"dtype {weight.dtype}", "torch.float8_e4m3fn", fix)
    if weight.dim() != 3:
        raise WeightsError(file, key, f"shape {list(weight.shape)}", "[E, N, K]")
    if scale is None:
        raise WeightsError(file, scale_key, "no tensor", f"the scale of {key}", _FIX_RESAVE)
    e, rows, cols = weight.shape
    want = scale_shape(quant, e, rows, cols)
    if quant.method is Quantization.FP8_CHANNEL:
        if tuple(scale.shape) in ((e,), (e, 1)):  # per-tensor: every row shares its scale
            scale = scale.reshape(e, 1).expand(e, rows)
        elif tuple(scale.shape) == (e, rows, 1):
            scale = scale.reshape(e, rows)
    if tuple(scale.shape) != want:
        block = (
            f" (block {quant.block[0]}x{quant.block[1]})"
            if quant.method.value == "fp8_block"
            else ""
        )
        raise WeightsError(
            file, scale_key, f"shape {list(scale.shape)}", f"shape {list(want)}{block}",
            "check weight_block_size in quantization_config against the checkpoint",
        )  # fmt: skip
    scale = scale.float().contiguous()
    bad = ~torch.isfinite(scale) | (scale <= 0)
    if bool(bad.any()):
        where = [int(i) for i in bad.nonzero()[0]]
        found = f"{scale[tuple(where)].item()} at {where}"
        raise WeightsError(file, scale_key, found, "finite positive scales", _FIX_RESAVE)
    return scale


@dataclass(frozen=True)
class FP8ExpertWeights:
    """w13 [E, S*I, H] and w2 [E, H, I] in e4m3 with fp32 scales (see the module legend);
    optional biases b13 [E, S*I], b2 [E, H] in the serving dtype. `source` names the file
    the tensors came from, for the errors."""

    quant: QuantConfig
    w13: Tensor
    w2: Tensor
    w13_scale: Tensor
    w2_scale: Tensor
    b13: Tensor | None = None
    b2: Tensor | None = None
    source: str = IN_MEMORY

    def __post_init__(self) -> None:
        if not self.quant.method.is_fp8:
            raise WeightsError(self.source, "quant", self.quant.method.value, "an fp8 format")
        pairs = (("w13", "w13_scale"), ("w2", "w2_scale"))
        checked = [
            checked_fp8_pair(self.quant, self.source, w, getattr(self, w), s, getattr(self, s))
            for w, s in pairs
        ]  # every check passes before any field is replaced
        object.__setattr__(self, "w13_scale", checked[0])
        object.__setattr__(self, "w2_scale", checked[1])

    @property
    def nbytes(self) -> int:
        """Bytes of the weights and scales (what a decode step's floor counts)."""
        return sum(
            t.numel() * t.element_size() for t in (self.w13, self.w2, self.w13_scale, self.w2_scale)
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> ExpertWeights:
        """ExpertWeights in `dtype` (fp32: one rounding per element) tagged with the format, so
        the reference models its run-time activation quantization (W8A8)."""
        return ExpertWeights(
            dequantize(self.quant, self.w13, self.w13_scale).to(dtype),
            dequantize(self.quant, self.w2, self.w2_scale).to(dtype),
            self.b13,
            self.b2,
            quantization=self.quant,
        )


def _expand(quant: QuantConfig, scale: Tensor, rows: int, cols: int) -> Tensor:
    """scale (canonical shape) -> [E, N, K] or [E, N, 1], one value per weight element."""
    if quant.method is Quantization.FP8_BLOCK:
        bn, bk = quant.block
        full = scale.repeat_interleave(bn, dim=1).repeat_interleave(bk, dim=2)
        return full[:, :rows, :cols]
    return scale.unsqueeze(2)


def dequantize(quant: QuantConfig, weight: Tensor, scale: Tensor) -> Tensor:
    """weight [E, N, K] e4m3 * its scale -> fp32 [E, N, K] (one fp32 rounding per element).
    One expert at a time: the temporaries stay one expert's size (DeepSeek-V3's layer is
    45 GB in fp32)."""
    out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    for e in range(weight.shape[0]):
        full = _expand(quant, scale[e : e + 1], weight.shape[1], weight.shape[2])
        torch.mul(weight[e : e + 1].float(), full, out=out[e : e + 1])
    return out


def _quantize_one(quant: QuantConfig, w: Tensor) -> tuple[Tensor, Tensor]:
    """w [1, N, K] -> (e4m3 [1, N, K], canonical fp32 scale): the amax of each block (or
    row) maps to 448."""
    _, rows, cols = w.shape
    w = w.float()
    if quant.method is Quantization.FP8_BLOCK:
        bn, bk = quant.block
        nb, kb = -(-rows // bn), -(-cols // bk)
        padded = torch.zeros(1, nb * bn, kb * bk, device=w.device)
        padded[:, :rows, :cols] = w
        amax = padded.reshape(1, nb, bn, kb, bk).abs().amax(dim=(2, 4))
    else:
        amax = w.abs().amax(dim=2)
    scale = amax.clamp(min=1e-12) / FP8_E4M3_MAX
    q = (w / _expand(quant, scale, rows, cols)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


def _quantize(quant: QuantConfig, w: Tensor) -> tuple[Tensor, Tensor]:
    """w [E, N, K] -> (e4m3 [E, N, K], canonical fp32 scale), one expert at a time."""
    parts = [_quantize_one(quant, w[e : e + 1]) for e in range(w.shape[0])]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


def quantize_experts(experts: ExpertWeights, quant: QuantConfig) -> FP8ExpertWeights:
    """Full-precision experts -> FP8ExpertWeights in `quant`'s format (biases kept as is)."""
    w13, s13 = _quantize(quant, experts.w13)
    w2, s2 = _quantize(quant, experts.w2)
    return FP8ExpertWeights(quant, w13, w2, s13, s2, experts.b13, experts.b2)
