"""`moelora validate --quantization`: FP8 experts (the random weights quantized) on the
triton backend against the reference on their dequantization, with the FP8 row of the
tolerance table; a format the backend lacks is a refused row, not a silent pass."""

from __future__ import annotations

import pytest
import torch

from moelora import cli
from moelora.compare import REL_TOL
from moelora.presets import PRESETS

TOL = f"{REL_TOL[torch.float8_e4m3fn]:.0e}"
BASE = ["validate", "--device", "cpu", "--models", "tiny", "--tokens", "5", "--quick"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_validate_fp8_block_passes_with_the_fp8_tolerance(dtype, capsys) -> None:
    code = cli.main([*BASE, "--quantization", "fp8", "--dtype", dtype])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("triton")]
    assert code == 0 and "validate: 1/1 passed" in out
    assert len(rows) == 1, rows
    rel_err, rel_tol, _max_abs, verdict = rows[0].split()[-5:-1]  # the time is last
    assert (rel_tol, verdict) == (TOL, "pass") and float(rel_err) <= float(TOL), rows[0]


def test_validate_refuses_a_format_the_backend_lacks(capsys) -> None:
    code = cli.main([*BASE, "--quantization", "fp8_channel"])
    out = capsys.readouterr().out
    assert code == 1 and "quantization = fp8_channel" in out and "0/1 passed" in out


def test_validate_rejects_an_unknown_format(capsys) -> None:
    assert "tiny" in PRESETS
    assert cli.main([*BASE, "--quantization", "int4"]) == 2
    assert "quantization" in capsys.readouterr().err
