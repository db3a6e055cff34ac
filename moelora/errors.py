"""The user-facing error types and the exit codes every command shares.

Each message names the field, the value, what was expected and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence

# One meaning per exit code, across every `moelora` command (docs/plan.md).
EXIT_OK = 0  # done: accepted (plan), or ran and every check that ran passed
EXIT_FAILED = 1  # ran, and a result differed from the reference (demo, validate, bench)
EXIT_USAGE = 2  # bad usage, configuration or input; nothing ran (argparse's code too)
EXIT_REFUSED = 3  # well formed, but the backend oracle refused it: no backend asked for runs it
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C (SIGINT): 128 + 2, as a shell reports it


class MoeloraError(Exception):
    """Base class of every error moelora raises on purpose."""


class ConfigError(MoeloraError, ValueError):
    """A model, LoRA or parallel configuration is unknown or inconsistent."""

    def __init__(self, key: str, value: object, expected: str, fix: str = "") -> None:
        self.key, self.value, self.expected, self.fix = key, value, expected, fix
        msg = f"config key '{key}' = {value!r}: expected {expected}"
        super().__init__(msg + (f". Fix: {fix}" if fix else ""))


class InputError(MoeloraError, ValueError):
    """A tensor passed to a forward has the wrong shape, dtype or device."""

    def __init__(self, name: str, got: object, expected: str) -> None:
        self.name, self.got, self.expected = name, got, expected
        super().__init__(f"input '{name}' is {got}: expected {expected}")


class UnsupportedDeploymentError(MoeloraError):
    """The requested backend cannot run this deployment (or, under auto, no backend can).

    Raised by the oracle at startup, before any weight is loaded. `reasons` lists every
    failing capability of the requested backend; `accepting` the backends that would run it;
    `nearest` the smallest changes of the settings after which a backend accepts it, as
    (backend, (change, ...)) pairs, each re-checked against that backend's record.
    """

    def __init__(
        self,
        requested: str,
        reasons: dict[str, list],
        accepting: list[str],
        nearest: Sequence[tuple[str, tuple[str, ...]]] = (),
    ) -> None:
        self.requested, self.reasons, self.accepting = requested, reasons, accepting
        self.nearest = tuple(nearest)
        head = f"moe backend '{requested}' cannot run this deployment:"
        if requested == "auto":
            head = "no moe backend can run this deployment (requested auto):"
        lines = [head]
        for backend, backend_reasons in reasons.items():
            lines += [f"  {backend}: {reason}" for reason in backend_reasons]
        if accepting:
            lines.append(f"backends that would accept it: {', '.join(accepting)}")
        lines.append(f"Fix: {self.fix}")
        super().__init__("\n".join(lines))

    @property
    def fix(self) -> str:
        """One line: another backend that accepts it as is, and/or the nearest deployments."""
        parts = []
        if self.accepting:
            parts.append(f"use --moe-backend {self.accepting[0]} (or auto)")
        parts += [f"{' '.join(changes)} ({name} then accepts it)" for name, changes in self.nearest]
        if not parts:
            return (
                "no setting of this deployment that moelora can change makes a backend "
                "accept it (the failing capabilities above are the model's own)"
            )
        return "; or ".join(parts)


class AdapterError(MoeloraError, ValueError):
    """An adapter directory or file is missing, unsafe, malformed or does not fit the model.

    Names the file, the key (tensor name or config field), what was found and what was
    expected, and the fix.
    """

    def __init__(self, file: str, key: str, found: object, expected: str, fix: str = "") -> None:
        self.file, self.key, self.found, self.expected, self.fix = file, key, found, expected, fix
        msg = f"adapter file '{file}', key '{key}': found {found}, expected {expected}"
        super().__init__(msg + (f". Fix: {fix}" if fix else ""))


class AdapterProblems(AdapterError):
    """Several independent refusals of one adapter, listed one per line, so that fixing the
    first does not only reveal the next. `problems` holds each AdapterError; file, key,
    found, expected and fix are the first one's (for callers that read a single problem).
    """

    SHOWN = 12  # lines listed in the message; `problems` keeps every one

    def __init__(self, problems: Sequence[AdapterError]) -> None:
        flat: list[AdapterError] = []
        for p in problems:
            flat += p.problems if isinstance(p, AdapterProblems) else [p]
        self.problems = tuple(flat)
        first = self.problems[0]
        self.file, self.key, self.found = first.file, first.key, first.found
        self.expected, self.fix = first.expected, first.fix
        lines = [f"{len(flat)} problems, each of which refuses this adapter:"]
        lines += [f"  {n}. {p}" for n, p in enumerate(flat[: self.SHOWN], 1)]
        if len(flat) > self.SHOWN:
            lines.append(f"  ... and {len(flat) - self.SHOWN} more (the error's .problems)")
        MoeloraError.__init__(self, "\n".join(lines))


def adapter_refusal(problems: Sequence[AdapterError]) -> AdapterError:
    """The one error to raise for `problems` (non-empty): the problem itself when there is
    one, else an AdapterProblems listing them all."""
    return problems[0] if len(problems) == 1 else AdapterProblems(problems)


def exit_code(err: MoeloraError) -> int:
    """EXIT_REFUSED for an oracle refusal, EXIT_USAGE for every other error moelora raises."""
    return EXIT_REFUSED if isinstance(err, UnsupportedDeploymentError) else EXIT_USAGE


class WeightsError(MoeloraError, ValueError):
    """Base expert weights (a checkpoint's tensors, or a quantized container) are missing,
    malformed or in a format the kernels lack. Names the file (or "in memory"), the key,
    what was found, what was expected and the fix; raised before anything is kept."""

    def __init__(self, file: str, key: str, found: object, expected: str, fix: str = "") -> None:
        self.file, self.key, self.found, self.expected, self.fix = file, key, found, expected, fix
        msg = f"weights '{file}', key '{key}': found {found}, expected {expected}"
        super().__init__(msg + (f". Fix: {fix}" if fix else ""))
