"""The backend oracle: the only place in moelora that chooses a backend.

select(deployment):
- explicit request (deployment.backend is a name): that backend runs if `check` finds no
  reason; otherwise UnsupportedDeploymentError names every failing capability and the
  backends that would accept. Never a substitution.
- auto: the first backend of the ranking (registry order, fastest first) with no reason.
A refusal also carries the nearest deployments that would run (moelora.nearest: the
smallest changes of the settings after which a backend accepts, re-checked).
LoRA is only more fields of the deployment; there is no LoRA branch here.
Either way one INFO line states the selection, the request, how, and every other backend's
reasons. Runs without a GPU: the deployment carries the (possibly named) device's facts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from .backends.base import Backend, Reason, check
from .deployment import AUTO, Deployment
from .errors import ConfigError, UnsupportedDeploymentError
from .nearest import nearest

log = logging.getLogger(__name__)

EXPLICIT = "explicit"


@dataclass(frozen=True)
class Selection:
    """The oracle's answer: the backend, how it was chosen, and why the others were not."""

    backend: Backend
    deployment: Deployment
    how: str  # "explicit" or "auto"
    others: tuple[tuple[str, tuple[Reason, ...]], ...]  # every other backend, registry order

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def requested(self) -> str:
        return self.deployment.backend

    def log_line(self) -> str:
        """Selected, requested, how, and each other backend with its reasons."""
        turned_down = "; ".join(
            f"{name} ({', '.join(map(str, reasons)) or self._passing_note()})"
            for name, reasons in self.others
        )
        return (
            f"moe backend for {self.deployment.name}: selected {self.name} "
            f"(requested {self.requested}, {self.how}); "
            f"turned down: {turned_down or 'none (only backend)'}"
        )

    def _passing_note(self) -> str:
        # A backend with no reason was turned down only by the request or the ranking.
        return (
            "passes, not requested" if self.how == EXPLICIT else f"passes, ranked below {self.name}"
        )


def default_registry() -> Mapping[str, Backend]:
    from .backends.registry import REGISTRY

    return REGISTRY


def evaluate(
    deployment: Deployment, registry: Mapping[str, Backend] | None = None
) -> dict[str, list[Reason]]:
    """name -> reasons (empty = accepts), for every backend, in ranking order."""
    registry = default_registry() if registry is None else registry
    return {name: check(backend.capabilities, deployment) for name, backend in registry.items()}


def select(deployment: Deployment, registry: Mapping[str, Backend] | None = None) -> Selection:
    """Choose the backend for one MoE layer type (see the module docstring).

    registry: name -> Backend in ranking order; None = moelora.backends.registry.REGISTRY.
    Raises ConfigError for an unknown backend name, UnsupportedDeploymentError on refusal.
    """
    registry = default_registry() if registry is None else registry
    verdicts = evaluate(deployment, registry)
    accepting = [name for name, reasons in verdicts.items() if not reasons]
    requested = deployment.backend
    if requested == AUTO:
        if not accepting:
            raise UnsupportedDeploymentError(AUTO, verdicts, [], nearest(deployment, registry))
        chosen, how = accepting[0], AUTO
    else:
        if requested not in registry:
            raise ConfigError(
                "moe_backend",
                requested,
                f"'{AUTO}' or a registered backend ({', '.join(registry) or 'none'})",
                "pick one of the listed backends",
            )
        if verdicts[requested]:
            raise UnsupportedDeploymentError(
                requested,
                {requested: verdicts[requested]},
                accepting,
                nearest(deployment, registry, [requested]),
            )
        chosen, how = requested, EXPLICIT
    others = tuple((n, tuple(r)) for n, r in verdicts.items() if n != chosen)
    selection = Selection(registry[chosen], deployment, how, others)
    log.info(selection.log_line())
    return selection
