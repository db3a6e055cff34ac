"""`Quantization`: the base experts' storage formats, and their reading from a Hugging Face
config's `quantization_config` (the block size comes from there). Data at the config tier
(config.py, weights.py and deployment.py hold it; quant/ holds the FP8 weights built on it):
imports nothing of moelora but errors.

FP8 is e4m3 (max 448). LoRA factors stay in the serving dtype whatever the format, and the
LoRA branch always sees the unquantized activations.

Legend: N a GEMM's output rows (S*I for w13, H for w2), K its input width (H, I).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# The K step of an FP8 dot, one activation group: Hopper's e4m3 MMA takes K in steps of 32
# (Triton refuses a smaller fp8 dot on NVIDIA GPUs; the interpreter accepts it); a
# [BLOCK_M, 256] e4m3 tile is the widest the kernels keep in shared memory.
FP8_MIN_STEP, FP8_MAX_STEP = 32, 256
DEFAULT_BLOCK = (128, 128)  # DeepSeek-V3 / Qwen3-FP8's weight_block_size


class Quantization(str, enum.Enum):
    """How the base experts are stored (one enum: a deployment's and a backend's field)."""

    NONE = "none"  # the serving dtype (bf16 / fp16 / fp32)
    # e4m3 weights, one fp32 `weight_scale_inv` per [128, 128] block of [N, K]; W8A8: each
    # base GEMM input is quantized per token and per group of the block's K side (128
    # columns) at run time, as transformers' FP8 experts, vLLM and SGLang run these
    # checkpoints (`activation_scheme: dynamic`).
    FP8_BLOCK = "fp8_block"
    # e4m3 weights, one fp32 scale per output row (per-tensor scales are broadcast to rows);
    # W8A8: each base GEMM input is quantized per token (the whole row) at run time.
    FP8_CHANNEL = "fp8_channel"

    @property
    def is_fp8(self) -> bool:
        return self is not Quantization.NONE

    @property
    def quantizes_inputs(self) -> bool:
        """Whether the base GEMMs see fp8-quantized inputs (dynamic W8A8): every FP8 format."""
        return self.is_fp8


@dataclass(frozen=True)
class QuantConfig:
    """A format and, for FP8_BLOCK, its block [rows of N, columns of K]."""

    method: Quantization = Quantization.NONE
    block: tuple[int, int] = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Quantization(self.method))
        block = tuple(self.block)
        if len(block) != 2 or any(not isinstance(b, int) or b < 1 for b in block):
            raise ConfigError("weight_block_size", list(block), "two positive ints [n, k]")
        object.__setattr__(self, "block", block)

    @property
    def activation_group(self) -> int | None:
        """Columns of a base GEMM input row sharing one activation scale: the block's K side
        under FP8_BLOCK, None (the whole row) under FP8_CHANNEL."""
        return self.block[1] if self.method is Quantization.FP8_BLOCK else None


# Formats people ship that these kernels do not run: what was found -> the fix.
_REFUSED = {
    "fmt": "re-quantize the experts to e4m3 (fmt: e4m3), or serve the bf16 checkpoint",
    "mxfp4": "serve the bf16 checkpoint (dequantize the MXFP4 experts first)",
    "nvfp4": "serve the bf16 checkpoint or an FP8 (e4m3) one",
}


def _refuse(key: str, value: object, found: str) -> ConfigError:
    return ConfigError(
        f"quantization_config.{key}",
        value,
        "fp8 e4m3 (128x128 block scales, or per-channel / per-tensor scales with dynamic "
        "activations)",
        _REFUSED[found],
    )


def from_hf_quantization(qc: dict[str, Any] | None) -> QuantConfig:
    """A config.json's `quantization_config` (as transformers writes it) -> QuantConfig.

    None or absent -> NONE. fp8 with `weight_block_size` -> FP8_BLOCK of that block; fp8
    without -> FP8_CHANNEL (dynamic activations). e5m2, MXFP4 and NVFP4 are refused naming
    the format and the fix.
    """
    if not qc:
        return QuantConfig()
    method = str(qc.get("quant_method", "")).lower()
    if method == "mxfp4":
        raise _refuse("quant_method", method, "mxfp4")
    algo = str(qc.get("quant_algo", "")).lower()
    if "nvfp4" in (method, algo) or "fp4" in algo:
        raise _refuse("quant_algo", qc.get("quant_algo", method), "nvfp4")
    if method != "fp8":
        raise ConfigError(
            "quantization_config.quant_method",
            method or None,
            "fp8 (or no quantization_config)",
            "serve an FP8 or a bf16 checkpoint",
        )
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _refuse("fmt", fmt, "fmt")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise ConfigError(
            "quantization_config.activation_scheme",
            scheme,
            "dynamic (activations quantized per token at run time)",
            "serve a checkpoint with dynamic activation scales",
        )
    block = qc.get("weight_block_size")
    if block is None:
        return QuantConfig(Quantization.FP8_CHANNEL)
    return QuantConfig(Quantization.FP8_BLOCK, tuple(block))


def resolve_quantization(flag: str | None, found: QuantConfig) -> QuantConfig:
    """`--quantization` (vLLM's flag) against the model's own format `found` (its config's
    quantization_config). None: the model's. `none`: full precision. `fp8`: the model's FP8
    format and block, FP8_BLOCK 128x128 when the config names none. A Quantization value
    (fp8_block, fp8_channel): that format, with the model's block."""
    if flag is None:
        return found
    if flag == "fp8":
        return found if found.method.is_fp8 else QuantConfig(Quantization.FP8_BLOCK)
    try:
        return QuantConfig(Quantization(flag), found.block)
    except ValueError:
        names = ", ".join(["fp8"] + [q.value for q in Quantization])
        raise ConfigError("quantization", flag, f"one of {names}", "pick one of them") from None
