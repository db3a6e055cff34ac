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
