"""`moelora validate --dtype`: the same cases in another dtype, judged by that dtype's
tolerance (the interpreter on CPU with the tiny preset here; a GPU runs the real shapes)."""

from __future__ import annotations

import pytest

from moelora import cli


@pytest.mark.parametrize("dtype,tol", [("fp32", "1e-05"), ("fp16", "2e-03")])
def test_validate_runs_in_the_requested_dtype(dtype, tol, capsys) -> None:
    args = ["--device", "cpu", "--models", "tiny", "--tokens", "3", "--quick", "--dtype", dtype]
    code = cli.main(["validate", *args])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("triton")]
    assert code == 0 and "validate: 1/1 passed" in out
    assert len(rows) == 1 and f" {tol}  pass" in rows[0]


def test_validate_rank_sets_the_sweep_rank(capsys) -> None:
    args = ["--device", "cpu", "--models", "tiny", "--tokens", "3,5", "--quick", "--rank", "32"]
    code = cli.main(["validate", *args, "--dtype", "fp32"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("triton")]
    assert code == 0 and "validate: 2/2 passed" in out
    assert len(rows) == 2 and all("L=8 R=32" in r and " pass" in r for r in rows)
    assert cli.main(["validate", "--device", "cpu", "--models", "tiny", "--rank", "0"]) == 2


def test_validate_refuses_an_unknown_dtype(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["validate", "--device", "cpu", "--models", "tiny", "--dtype", "fp8"])
    assert exc.value.code == 2 and "fp8" in capsys.readouterr().err
