"""Every benchmarks/ runner imports on a machine without a GPU (they run on the H200 only,
so a broken import would first show there, costing device time) and parses --help."""

from __future__ import annotations

import importlib
import pkgutil
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
