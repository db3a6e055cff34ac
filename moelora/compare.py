"""The one dtype tolerance table and the relative-error check used by tests, `validate` and
`bench` (outputs are checked against the reference before anything is timed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Relative error ||out - ref|| / ||ref||. fp32: fp32 arithmetic (allowing tf32-free GPU paths);
# fp16/bf16: operands rounded to 10/7 mantissa bits, fp32 accumulation.
REL_TOL: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
    # FP8 (e4m3) experts against the reference on the dequantized experts: bf16 activations,
    # plus, under W8A8, e4m3 roundings of a GEMM input that flip where the kernel's z and
    # the reference's differ by their summation order (one e4m3 step is 2^-4 relative).
    torch.float8_e4m3fn: 3e-2,
}


# Against an outside truth in 16-bit (a model's logits at depth), a row passes within
# max(its dtype's row, NOISE_FACTOR x the noise between two correct implementations
# measured in the same run): if each side is within the noise of the exact result, the two
# are within twice it of each other.
NOISE_FACTOR = 2


@dataclass(frozen=True)
class Comparison:
    rel_err: float
    max_abs: float
    tol: float

    @property
    def ok(self) -> bool:
        # NaN compares False, so NaN never passes.
        return self.rel_err <= self.tol

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        return f"rel_err={self.rel_err:.2e} max_abs={self.max_abs:.2e} tol={self.tol:.0e} {verdict}"


def compare(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None, tol: float | None = None
) -> Comparison:
    """Relative Frobenius error of out against ref, in float64."""
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: out {tuple(out.shape)} vs ref {tuple(ref.shape)}")
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    diff = o - r
    denom = r.norm().item()
    rel = diff.norm().item() / denom if denom > 0 else diff.norm().item()
    if not torch.isfinite(o).all():
        rel = float("nan")
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    limit = tol if tol is not None else REL_TOL[dtype or out.dtype]
    return Comparison(rel, max_abs, limit)


def assert_close(
    out: torch.Tensor,
    ref: torch.Tensor,
    dtype: torch.dtype | None = None,
    tol: float | None = None,
    what: str = "",
) -> Comparison:
    result = compare(out, ref, dtype, tol)
    if not result.ok:
        raise AssertionError(f"{what}: {result}")
    return result


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN before a kernel writes it (unwritten elements fail)."""
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-(2**30))
