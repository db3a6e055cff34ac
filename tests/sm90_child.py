"""Run a test file as a script with the Triton interpreter off (to compile kernels for
sm_90 without a GPU) and read the JSON it prints. The tests run under TRITON_INTERPRET=1,
where the kernels cannot be compiled, hence the child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_compile_child(script: str, timeout: int = 900) -> dict:
    """The JSON dict that `script`, run as a script, prints; it must name the moelora
    package it imported under "moelora", which must be this tree's (checked, removed)."""
    import moelora

    root = os.path.dirname(os.path.dirname(os.path.abspath(moelora.__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result.pop("moelora") == os.path.abspath(moelora.__file__)  # this tree's kernels
    return result
