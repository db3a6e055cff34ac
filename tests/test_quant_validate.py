"""`moelora validate --quantization`: FP8 experts (the random weights quantized, block or
per-channel scales) on the triton backend against the reference on their dequantization,
with the FP8 row of the tolerance table; a format a backend lacks is a refused row, not a
silent pass."""

from __future__ import annotations

import pytest
import torch

from moelora import cli
from moelora.compare import REL_TOL
from moelora.presets import PRESETS

TOL = f"{REL_TOL[torch.float8_e4m3fn]:.0e}"
BASE = ["validate", "--device", "cpu", "--models", "tiny", "--tokens", "5", "--quick"]


# (format flag, dtype) - both W8A8 formats on the triton backend
PASS_CASES = [("fp8", "fp32"), ("fp8", "bf16"), ("fp8_channel", "bf16")]


@pytest.mark.parametrize("fmt,dtype", PASS_CASES, ids=[f"{f}-{d}" for f, d in PASS_CASES])
def test_validate_fp8_passes_with_the_fp8_tolerance(fmt, dtype, capsys) -> None:
    code = cli.main([*BASE, "--quantization", fmt, "--dtype", dtype])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("triton")]
    assert code == 0 and "validate: 1/1 passed" in out
    assert len(rows) == 1, rows
    rel_err, rel_tol, _max_abs, verdict = rows[0].split()[-5:-1]  # the time is last
    assert (rel_tol, verdict) == (TOL, "pass") and float(rel_err) <= float(TOL), rows[0]


def test_validate_refuses_a_backend_that_cannot_run_the_format(capsys) -> None:
    """grouped_mm has no FP8 (and no CPU path): its row is refused, not a silent pass."""
    code = cli.main([*BASE, "--quantization", "fp8_channel", "--backends", "grouped_mm"])
    out = capsys.readouterr().out
    assert code == 1 and "UnsupportedDeploymentError" in out and "0/1 passed" in out


def test_validate_rejects_an_unknown_format(capsys) -> None:
    assert "tiny" in PRESETS
    assert cli.main([*BASE, "--quantization", "int4"]) == 2
    assert "quantization" in capsys.readouterr().err
