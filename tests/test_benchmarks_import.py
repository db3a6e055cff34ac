"""Every benchmarks/ runner imports on a machine without a GPU (they run on the H200 only,
so a broken import would first show there, costing device time) and parses --help."""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys

import pytest

import benchmarks

MODULES = sorted(info.name for info in pkgutil.iter_modules(benchmarks.__path__))


def test_the_runners_are_all_listed() -> None:
    assert {"gemm_ceiling", "read_floor", "tune", "ab_knob", "table_buckets"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_runner_imports_and_parses_help(name: str, monkeypatch, capsys) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    if not hasattr(module, "main"):
        return  # a library module (cases, floors, runner, table_buckets)
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as done:
        module.main()
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_every_runnable_module_is_registered_once() -> None:
    """The registry (benchmarks/registry.py) lists exactly the modules with a main(), so
    `python -m benchmarks` and benchmarks/README.md's index show every tool."""
    from benchmarks.registry import TOOLS

    runnable = {
        n
        for n in MODULES
        if n != "__main__" and hasattr(importlib.import_module(f"benchmarks.{n}"), "main")
    }
    assert set(TOOLS) == runnable
    assert all(tool.summary and "\n" not in tool.summary for tool in TOOLS.values())


def test_the_runner_lists_runs_and_refuses(monkeypatch, capsys) -> None:
    from benchmarks.__main__ import main as run
    from benchmarks.registry import TOOLS

    assert run([]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in TOOLS)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the runner rewrites argv
    with pytest.raises(SystemExit) as done:
        run(["launch_diff", "--help"])
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out
    assert run(["no_such_tool"]) == 2
    assert "no tool 'no_such_tool'" in capsys.readouterr().err


def test_every_script_is_in_the_scripts_index() -> None:
    """scripts/README.md lists each file of scripts/ (and nothing that is gone)."""
    from pathlib import Path

    folder = Path(benchmarks.__path__[0]).parent / "scripts"
    listed = set(re.findall(r"^\| `([\w.]+)` \|", (folder / "README.md").read_text(), re.M))
    assert listed == {p.name for p in folder.iterdir() if p.name != "README.md"}
