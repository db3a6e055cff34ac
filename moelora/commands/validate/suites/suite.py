"""What a check suite of `moelora validate --suite NAME` is, and how its verdicts print.

A check suite yields one `Verdict` per case: pass, FAIL, or not run here (a case that needs
what this machine lacks, e.g. CUDA graphs on a CPU, says so instead of passing). The run
prints one line per verdict and a count; any FAIL, or an error that stops the suite, makes
`moelora validate` exit 1.
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


class Outcome(enum.Enum):
    PASS = "pass"
    FAIL = "FAIL"
    NOT_RUN = "not run"  # needs what this machine lacks; counted neither way


@dataclass(frozen=True)
class Verdict:
    case: str  # what was checked
    outcome: Outcome
    detail: str  # what was seen, against what was wanted

    @staticmethod
    def of(case: str, ok: bool, detail: str) -> Verdict:
        return Verdict(case, Outcome.PASS if ok else Outcome.FAIL, detail)


@dataclass(frozen=True)
class CheckSuite:
    """name: the --suite value; summary: one line for --help; cpu_refusal: why it cannot
    run on a CPU at all (None: it runs what it can there); run(args, device, backend)
    yields the verdicts; uses_backend: whether its layers run the backend of --backends
    (once per backend) or no layer at all; add_arguments: its own options, if any;
    check_args(args, device): raises ConfigError for settings it refuses, before anything
    runs."""

    name: str
    summary: str
    cpu_refusal: str | None
    run: Callable[[argparse.Namespace, str, str], Iterator[Verdict]]
    uses_backend: bool = True
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    check_args: Callable[[argparse.Namespace, str], object] | None = None


def run_suite(suite: CheckSuite, args: argparse.Namespace, device: str, backend: str) -> int:
    """Print the suite's verdicts (backend: the moelora backend its layers ask the oracle
    for); returns the number of failures (an error that stops the suite counts as one)."""
    where = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    name = f"{suite.name} ({backend})" if suite.uses_backend else suite.name
    print(f"validate --suite {name} on {where}, torch {torch.__version__}")
    passed = failed = 0
    try:
        for verdict in suite.run(args, device, backend):
            passed += verdict.outcome is Outcome.PASS
            failed += verdict.outcome is Outcome.FAIL
            print(f"  {verdict.outcome.value:<7} {verdict.case}: {verdict.detail}", flush=True)
    except Exception as err:  # report and stop this suite: the others still run
        failed += 1
        msg = " ".join(str(err).split())
        print(f"  {Outcome.FAIL.value:<7} suite stopped: {type(err).__name__}: {msg[:300]}")
    tail = "" if not failed else " — FAILURES"
    print(f"validate --suite {name}: {passed}/{passed + failed} passed{tail}", flush=True)
    return failed
