"""Expert backends. Each module declares a `BACKEND` with its `Capabilities`; registry.py
lists them in ranking order; moelora.oracle is the only code that picks one."""

from .base import Backend, Capabilities, Reason, check

__all__ = ["Backend", "Capabilities", "Reason", "check"]
