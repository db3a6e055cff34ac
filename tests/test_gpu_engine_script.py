"""scripts/gpu_engine_check.py runs on the H200 for the engine's CUDA-graph path; a broken
import or a logic error would first show there, costing device time. Here it parses --help
and runs end to end on the CPU (graphs off there: both engines eager, so every check must
pass exactly), its JSON complete."""

from __future__ import annotations

import json

import pytest
from script_loader import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("gpu_engine_check")


def test_parses_help(script, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        script.main(["--help"])
    assert done.value.code == 0
    assert "--max-rows" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore")
def test_dry_run_on_cpu(script, tmp_path, capsys) -> None:
    argv = ["--device", "cpu", "--dtype", "float32", "--layers", "1", "--hidden", "128",
            "--experts", "8", "--moe-backend", "reference", "--max-rows", "8",
            "--new-tokens", "2", "--batches", "1,2", "--out", str(tmp_path)]  # fmt: skip
    assert script.main(argv) == 0
    result = json.loads((tmp_path / "gpu_engine_check.json").read_text())
    assert result["ok"] and len(result["checks"]) == 4
    assert all(c["pass"] for c in result["checks"].values())
    assert result["checks"]["graph equals eager"]["equal_tokens"] == 1.0
    assert set(result["decode_tokens_per_s"]) == {"1", "2"}
    assert "PASS handle.generate on the engine" in capsys.readouterr().out
