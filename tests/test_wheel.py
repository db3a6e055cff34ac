"""The package as a user installs it: a wheel built from this tree, installed into a fresh
venv outside the checkout, runs `moelora bench --help`, `moelora validate --help` and
`moelora plan`, and carries the H200 tile table (package data). Nothing is downloaded:
the wheel is built without build isolation, installed without dependencies, and the
fresh venv reaches this venv's torch / triton through a .pth file (not its editable
moelora: a .pth line adds a folder, the .pth files inside it are not run)."""

from __future__ import annotations

import re
import sysconfig
import zipfile
from pathlib import Path

import pytest
from venvs import ROOT, build_wheel, fresh_venv
from venvs import run as _run

# ~8 s here (a build, a venv, an install, four interpreters): not marked slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin folder of a fresh venv with the wheel of this tree installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(tmp)
    names = zipfile.ZipFile(wheel).namelist()
    assert "moelora/tiling/h200_table.json" in names and "moelora/bench/runner.py" in names
    assert not any(n.startswith("benchmarks/") for n in names)
    return fresh_venv(tmp, wheel, Path(sysconfig.get_paths()["purelib"]))


def test_the_wheel_runs_the_cli_outside_the_checkout(installed: Path, tmp_path: Path) -> None:
    where = _run(
        [installed / "python", "-c",
         "import moelora, moelora.tiling.pick as p; print(moelora.__file__, len(p.H200.rows))"],
        cwd=tmp_path,
    ).stdout.split()  # fmt: skip
    assert where[0].startswith(str(installed.parent)), where  # the wheel's, not the checkout's
    assert int(where[1]) > 40  # the packaged table loaded
    moelora = installed / "moelora"
    assert "--suite" in _run([moelora, "bench", "--help"], cwd=tmp_path).stdout
    assert "--quick" in _run([moelora, "validate", "--help"], cwd=tmp_path).stdout
    plan = _run([moelora, "plan", "--model", "qwen3-30b-a3b", "--device", "h200"], cwd=tmp_path)
    assert "triton" in plan.stdout
    # the version comes from the installed distribution's metadata (pyproject.toml)
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    assert _run([moelora, "--version"], cwd=tmp_path).stdout == f"moelora {version}\n"
