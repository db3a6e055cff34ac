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

A check whose result a later one needs stays outside: the later one could not run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import AdapterError, adapter_refusal


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
            self.errors.append(err)

    def raise_any(self) -> None:
        """Raise the kept errors as one (nothing when every check passed)."""
        if self.errors:
            raise adapter_refusal(self.errors)
