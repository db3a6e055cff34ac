"""Refusals: the independent checks of one adapter run to the end, so that its error lists
every problem found (a fused orientation nothing decides AND a NaN factor AND an int8 one),
not only the first. A caller with checks of its own (the transformers integration refuses
LoRA on modules it cannot apply, e.g. a router) runs them in the same collector, around
load_adapter: its AdapterProblems is flattened into the list.

    refusals = Refusals()
    with refusals.check():
        parse(...)            # an AdapterError here is kept, and the next check still runs
    with refusals.check():
        check_tensors(...)
    refusals.raise_any()      # raises one error naming them all (errors.adapter_refusal)

A check whose result a later one needs stays outside: the later one could not run. Two
checks that read the same file can both meet one fault (a truncated safetensors file): an
error identical to one already kept is dropped, so each problem is listed once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import AdapterError, AdapterProblems, adapter_refusal


class Refusals:
    """The AdapterErrors of one adapter's independent checks, raised together."""

    def __init__(self) -> None:
        self.errors: list[AdapterError] = []

    @contextmanager
    def check(self) -> Iterator[None]:
        """Run the block; keep an AdapterError it raises (other exceptions propagate)."""
        try:
            yield
        except AdapterError as err:
            problems = err.problems if isinstance(err, AdapterProblems) else (err,)
            kept = {_identity(e) for e in self.errors}
            for problem in problems:
                if _identity(problem) not in kept:
                    self.errors.append(problem)
                    kept.add(_identity(problem))

    def raise_any(self) -> None:
        """Raise the kept errors as one (nothing when every check passed)."""
        if self.errors:
            raise adapter_refusal(self.errors)


def _identity(err: AdapterError) -> tuple:
    """What the user reads of one problem: its type, file, key, found, expected and fix."""
    return type(err), err.file, err.key, str(err.found), err.expected, err.fix
