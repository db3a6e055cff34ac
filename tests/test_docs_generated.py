"""The generated parts of the docs (benchmarks/report.py) match the committed data they
come from: the top of BENCHMARKS.md (the current bench JSON), the knob table of
docs/kernels.md (moelora/tiling/h200_table.json) and benchmarks/README.md's index (the
tool registry). A new bench result, table row or tool shows here until
`python -m benchmarks report` is re-run."""

from __future__ import annotations

from benchmarks import report


def test_generated_blocks_are_current() -> None:
    assert report.stale() == [], "run: python -m benchmarks.report"


def test_the_current_table_names_its_source_and_plot() -> None:
    text = (report.ROOT / "BENCHMARKS.md").read_text()
    top = text.split("## History")[0]
    assert f"benchmarks/results/{report.CURRENT}" in top and report.PLOT in top
    assert (report.ROOT / report.PLOT).stat().st_size > 10_000  # the committed PNG


def test_every_code_path_knob_is_listed() -> None:
    """Each knob that switches a code path has a line, used or not (a knob no row uses
    says so instead of being left out)."""
    block = report.knob_block()
    for knob in report.PATH_KNOBS:
        assert f"| `{knob}" in block, knob
