"""The check suites of `moelora validate --suite NAME`: GPU checks a user runs that are not
rows of the layer table (those are cases.py's layer suites). Each module holds one
suite; the registry is filled in a fixed order by explicit imports."""

from __future__ import annotations

from . import hf, parallel, serving, slots
from .suite import CheckSuite, Outcome, Verdict, run_suite

CHECK_SUITES: dict[str, CheckSuite] = {
    s.name: s for s in (slots.SUITE, hf.SUITE, serving.SUITE, parallel.SUITE)
}

__all__ = ["CHECK_SUITES", "CheckSuite", "Outcome", "Verdict", "run_suite"]
