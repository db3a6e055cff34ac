"""The README's Python snippets run as printed on a CPU, and print what they computed: a
newcomer pastes them first. Each runs in a fresh interpreter from an empty directory (no
TRITON_INTERPRET: the defaults a user has). The torchrun snippet runs in
tests/test_parallel_bench.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def snippet(section: str) -> str:
    """The first ```python block after the README heading `section`."""
    text = (ROOT / "README.md").read_text().split(f"\n{section}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", text, re.S)[1]


# (section heading, what its output must hold)
SNIPPETS = [
    # attach, two PEFT adapters and a base row; the selection in plain words; whole rows
    ("## Your transformers model, many adapters in one batch",
     [r"moe backend for qwen3_moe: selected reference, auto: the fastest backend",
      r"math: \[\d+(, \d+){7}\]", r"code: \[\d+(, \d+){7}\]", r"base: \[\d+(, \d+){7}\]"]),
    # one layer: the backend it ran and the output's shape and size
    ("## Using it as a library (one layer)",
     [r"backend reference: y \(16, 64\) torch\.float32, \|y\| = \d+\.\d{3}"]),
]  # fmt: skip


@pytest.mark.parametrize("section, want", SNIPPETS, ids=["transformers", "library"])
def test_readme_snippet_runs_as_printed(section, want, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", snippet(section)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for pattern in want:
        assert re.search(pattern, done.stdout), (pattern, done.stdout)
    assert "Traceback" not in done.stderr, done.stderr
