"""The user-facing error types. Each message names the field, the value, what was expected and the fix."""

from __future__ import annotations


class MoeloraError(Exception):
    """Base class of every error moelora raises on purpose."""


class ConfigError(MoeloraError, ValueError):
    """A model, LoRA or parallel configuration is unknown or inconsistent."""

    def __init__(self, key: str, value: object, expected: str, fix: str = "") -> None:
        self.key, self.value, self.expected = key, value, expected
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
    failing capability of the requested backend; `accepting` the backends that would run it.
    """

    def __init__(self, requested: str, reasons: dict[str, list], accepting: list[str]) -> None:
        self.requested, self.reasons, self.accepting = requested, reasons, accepting
        head = f"moe backend '{requested}' cannot run this deployment:"
        if requested == "auto":
            head = "no moe backend can run this deployment (requested auto):"
        lines = [head]
        for backend, backend_reasons in reasons.items():
            lines += [f"  {backend}: {reason}" for reason in backend_reasons]
        if accepting:
            fix = f"use --moe-backend {accepting[0]} (or auto), or change the settings above"
            lines.append(f"backends that would accept it: {', '.join(accepting)}. Fix: {fix}")
        else:
            lines.append("no registered backend accepts it. Fix: change the settings above")
        super().__init__("\n".join(lines))


class AdapterError(MoeloraError, ValueError):
    """An adapter directory or file is missing, unsafe, malformed or does not fit the model.

    Names the file, the key (tensor name or config field), what was found and what was
    expected, and the fix.
    """

    def __init__(self, file: str, key: str, found: object, expected: str, fix: str = "") -> None:
        self.file, self.key, self.found, self.expected = file, key, found, expected
        msg = f"adapter file '{file}', key '{key}': found {found}, expected {expected}"
        super().__init__(msg + (f". Fix: {fix}" if fix else ""))
