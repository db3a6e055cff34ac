"""scripts/gpu_serving_check.py runs on the H200 only for its timings, so a broken import or
a logic error would first show there, costing device time: here it parses --help, refuses
settings it cannot measure, and runs end to end on the CPU (tiny preset, reference backend),
its checks passing and its JSON complete."""

from __future__ import annotations

import json

import pytest
from script_loader import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("gpu_serving_check")


def test_parses_help(script, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        script.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and "--cold" in out


# (id, arguments, fragment of the refusal)
REFUSED = [
    ("no-cold-miss", ["--slots", "8", "--hot", "4", "--cold", "4"], "cold > slots - hot"),
    ("hot-fills-slots", ["--slots", "4", "--hot", "4"], "0 < hot < slots"),
]


@pytest.mark.parametrize("argv,fragment", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refuses_settings_it_cannot_measure(script, argv, fragment) -> None:
    with pytest.raises(SystemExit, match=fragment):
        script.main(argv)


def test_dry_run_on_cpu(script, tmp_path, capsys) -> None:
    argv = ["--device", "cpu", "--preset", "tiny", "--layers", "2", "--slots", "4", "--hot",
            "2", "--cold", "4", "--rank", "4", "--tokens", "16", "--forwards", "3",
            "--load-rounds", "1", "--bandwidth-reps", "2", "--moe-backend", "reference",
            "--out", str(tmp_path)]  # fmt: skip
    assert script.main(argv) == 0
    result = json.loads((tmp_path / "gpu_serving_check.json").read_text())
    assert result["checks"]["ok"] and result["checks"]["slots_exact"] == 4
    assert result["loads_alone"]["loads"] == 4 and result["loads_alone"]["origins"] == ["host"]
    assert result["loads_beside_forwards"]["loads"] > 0
    stats = result["stats"]
    assert sum(stats["loads"].values()) == stats["misses"] + stats["explicit_loads"]
    assert stats["host_adapters"] <= stats["host_capacity"] == 4
    assert "checks: slots bit-exact 4/4" in capsys.readouterr().out
