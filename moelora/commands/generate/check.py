"""`moelora generate`'s check: each row against HF + PEFT generating it alone, and the
verdict, which names the rows and values that decided it.

fp32 (the default): both sides compute IEEE fp32 dots, so the row's new tokens must be
equal and its prompt logits within the fp32 table tolerance. 16-bit (what serving runs):
two correct implementations round differently, so greedy rows may part after a few tokens;
only the prompt logits are held, to max(the dtype's table tolerance, 2 x HF's own noise)
measured in the run (measure_noise in truth/hf_peft.py: two of HF's experts implementations,
and HF against itself in fp32). Why twice: if moelora and HF are each within the noise of the
exact result, they are within twice it of each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...compare import NOISE_FACTOR, REL_TOL, compare
from ...deployment import dtype_name
from ...truth.hf_peft import Noise


@dataclass(frozen=True)
class RowCheck:
    """One row: moelora's new tokens against HF + PEFT's (`want`), and the relative error
    of its prompt logits [S, V] against HF + PEFT's."""

    row: int
    name: str | None
    new: list[int]
    want: list[int]
    logits_rel_err: float

    @property
    def first_difference(self) -> int | None:
        """The first step whose token differs, or None when the rows are equal."""
        return next((i for i, (a, b) in enumerate(zip(self.new, self.want)) if a != b), None)

    def cell(self) -> str:
        """The row's check as the table prints it."""
        step = self.first_difference
        tokens = "equal tokens" if step is None else f"tokens differ from step {step}"
        return f"{tokens}, logits rel err {self.logits_rel_err:.1e}"


def check_row(truth, row: int, name, prompt, new: list[int], logits, pad: int) -> RowCheck:
    """HF + PEFT alone (`truth`) on `prompt` [S]: its greedy tokens and prompt logits [S, V]
    against moelora's `new` tokens and `logits` [S, V] for the row."""
    with torch.no_grad():
        want_logits = truth(input_ids=prompt[None]).logits[0]
        ref = truth.generate(
            input_ids=prompt[None], max_new_tokens=len(new), min_new_tokens=len(new),
            do_sample=False, pad_token_id=pad,
        )  # fmt: skip
    err = compare(logits, want_logits, tol=float("inf")).rel_err
    return RowCheck(row, name, new, ref[0, len(prompt) :].tolist(), err)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    tol: float
    rule: str  # how the tolerance was set, in words
    text: str  # the verdict line, naming the rows and values that decided it


def tolerance(dtype: torch.dtype, noise: list[Noise]) -> tuple[float, str]:
    """(relative tolerance of the prompt logits, how it was set). NaN noise adds nothing."""
    table = REL_TOL[dtype]
    if dtype == torch.float32 or not noise:
        tokens = " and equal tokens" if dtype == torch.float32 else ""
        return table, f"tol {table:.1e} ({dtype_name(dtype)} table){tokens}"
    largest = max((n.rel_err for n in noise if n.rel_err == n.rel_err), default=0.0)
    tol = max(table, NOISE_FACTOR * largest)
    return tol, (
        f"tol {tol:.1e} = max({dtype_name(dtype)} table {table:.1e}, "
        f"{NOISE_FACTOR} x HF's own noise {largest:.1e})"
    )


def verdict(checks: list[RowCheck], dtype: torch.dtype, noise: list[Noise]) -> Verdict:
    """PASS when every row is within the tolerance (and, in fp32, has equal tokens);
    otherwise FAIL naming each failing row with its value."""
    tol, rule = tolerance(dtype, noise)
    strict = dtype == torch.float32
    failing = []
    for c in checks:
        label = f"row {c.row} {c.name or 'base'}"
        if not c.logits_rel_err <= tol:  # NaN fails
            failing.append(f"{label} (logits rel err {c.logits_rel_err:.1e} > {tol:.1e})")
        elif strict and c.first_difference is not None:
            failing.append(f"{label} (tokens differ from step {c.first_difference})")
    if failing:
        return Verdict(False, tol, rule, f"FAIL: {', '.join(failing)}; {rule}")
    worst = max(checks, key=lambda c: c.logits_rel_err)
    largest = f"row {worst.row} {worst.name or 'base'} at {worst.logits_rel_err:.1e}"
    text = f"PASS: every row within {rule}; largest logits rel err: {largest}"
    return Verdict(True, tol, rule, text)


@dataclass(frozen=True)
class CheckResult:
    """The whole check: each row's, the HF experts implementation the truth ran, HF's own
    noise (empty in fp32) and the verdict."""

    rows: list[RowCheck]
    implementation: str
    noise: list[Noise]
    verdict: Verdict
