"""Prometheus' text exposition format, written by hand (no dependency): metric families,
label values escaped, histograms with cumulative buckets. What `prometheus_client` writes
for the same families, so its parser (and every scraper) reads them alike: a counter's
`# TYPE` names it with its `_total` suffix, labels go in the order given, `le` last.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

Labels = Sequence[tuple[str, str]]


def escape(value: str) -> str:
    """A label value as the format writes it: backslash, double quote and newline escaped
    (an adapter's name is any string a client or operator chose)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def labels(pairs: Labels) -> str:
    """`{a="x",b="y"}`, or nothing for no labels."""
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{escape(str(v))}"' for k, v in pairs) + "}"


def number(value: float) -> str:
    """A sample value or bucket bound: ints as they are, floats in Python's shortest form."""
    if value == float("inf"):
        return "+Inf"
    return str(value) if isinstance(value, int) else repr(float(value))


def family(
    name: str, kind: str, help_text: str | None, samples: Iterable[tuple[Labels, float]]
) -> list[str]:
    """The lines of one gauge or counter family (`name` as exposed: a counter's ends in
    `_total`)."""
    head = [] if help_text is None else [f"# HELP {name} {help_text}"]
    head.append(f"# TYPE {name} {kind}")
    return head + [f"{name}{labels(pairs)} {number(value)}" for pairs, value in samples]


class Histogram:
    """Observations counted in buckets of upper bounds `bounds` (seconds), plus +Inf; not
    thread-safe (Metrics holds its lock around it)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float) -> None:
        index = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[index] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def samples(self, name: str, pairs: Labels = ()) -> list[str]:
        """The `_bucket` (cumulative, `le` last), `_sum` and `_count` lines."""
        out, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            running += count
            out.append(f"{name}_bucket{labels([*pairs, ('le', number(float(bound)))])} {running}")
        return [*out, f"{name}_sum{labels(pairs)} {self.total!r}",
                f"{name}_count{labels(pairs)} {running}"]  # fmt: skip


def histograms(
    name: str, help_text: str | None, series: Iterable[tuple[Labels, Histogram]]
) -> list[str]:
    """The lines of one histogram family: one series per (labels, histogram)."""
    lines = [] if help_text is None else [f"# HELP {name} {help_text}"]
    lines.append(f"# TYPE {name} histogram")
    for pairs, histogram in series:
        lines += histogram.samples(name, pairs)
    return lines
