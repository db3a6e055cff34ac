"""The registry of the developer tools in benchmarks/: each runnable module once, with
what it needs (a GPU, several under torchrun, or none) and what kind of answer it gives.
`python -m benchmarks` lists them and runs one; benchmarks/README.md's index is generated
from this table (benchmarks/report.py). What each does is its module docstring's first
sentence, read from the file (not imported: most need a GPU stack).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

HERE = Path(__file__).resolve().parent


class Kind(Enum):
    TUNE = "tune"  # writes the tile table
    AB = "A/B"  # two settings or two trees, timed in the same run
    TIMING = "timing"  # where the time goes, ceilings and floors
    CHECK = "check"  # a yes / no answer, no timing
    REPORT = "report"  # tables and docs from committed results
    RESULTS = "results"  # keeps the committed results


class Needs(Enum):
    GPU = "a CUDA GPU"
    CPU = "nothing (CPU)"


@dataclass(frozen=True)
class Tool:
    name: str  # the module in benchmarks/
    kind: Kind
    needs: Needs

    @property
    def summary(self) -> str:
        """The module docstring's opening clause (up to its first colon, full stop or
        question mark)."""
        text = ast.get_docstring(ast.parse((HERE / f"{self.name}.py").read_text())) or ""
        first = " ".join(text.split("\n\n")[0].split())
        return re.split(r"(?<=[?])\s|[:.](?:\s|$)", first, maxsplit=1)[0]


TOOLS: dict[str, Tool] = {
    t.name: t
    for t in (
        Tool("tune", Kind.TUNE, Needs.GPU),
        Tool("ab_knob", Kind.AB, Needs.GPU),
        Tool("ab_decode", Kind.AB, Needs.GPU),
        Tool("ab_align", Kind.AB, Needs.GPU),
        Tool("ab_trees", Kind.AB, Needs.GPU),
        Tool("profile_layer", Kind.TIMING, Needs.GPU),
        Tool("fp8_sweep", Kind.TUNE, Needs.GPU),
        Tool("lora_cost", Kind.TIMING, Needs.GPU),
        Tool("gemm_ceiling", Kind.TIMING, Needs.GPU),
        Tool("read_floor", Kind.TIMING, Needs.GPU),
        Tool("fp8_generate", Kind.TIMING, Needs.GPU),
        Tool("decode_profile", Kind.TIMING, Needs.GPU),
        Tool("mixed_step", Kind.TIMING, Needs.GPU),
        Tool("ab_dense_linear", Kind.AB, Needs.GPU),
        Tool("serve_load", Kind.TIMING, Needs.GPU),
        Tool("admission_sim", Kind.TIMING, Needs.CPU),
        Tool("class_neighbours", Kind.CHECK, Needs.GPU),
        Tool("launch_diff", Kind.CHECK, Needs.CPU),
        Tool("report", Kind.REPORT, Needs.CPU),
        Tool("lora_sweep_report", Kind.REPORT, Needs.CPU),
        Tool("archive", Kind.RESULTS, Needs.CPU),
    )
}
