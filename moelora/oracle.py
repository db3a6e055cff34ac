"""The backend oracle: the only place in moelora that chooses a backend.

select(deployment):
- explicit request (deployment.backend is a name): that backend runs if `check` finds no
  reason; otherwise UnsupportedDeploymentError names every failing capability and the
  backends that would accept. Never a substitution.
- auto: the first backend of the ranking with no reason. The ranking is the registry order
  (fastest first on a GPU), except that a backend which would run through Triton's CPU
  interpreter here (its record's `cpu_needs_interpreter`, on a cpu device) ranks after every
  backend that runs natively: interpreted kernels are exact but slow (the default
  `moelora generate` took 21.2 s interpreted against 6.9 s on `reference`). An explicit
  request for it is still honoured.
A refusal also carries the nearest deployments that would run (moelora.nearest: the
smallest changes of the settings after which a backend accepts, re-checked).
LoRA is only more fields of the deployment; there is no LoRA branch here.
Either way one INFO line states, in plain words, the selection, why, and every other
backend's reasons. Runs without a GPU: the deployment carries the (possibly named) device's facts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from .backends.base import Backend, Capabilities, Reason, check
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
    others: tuple[tuple[str, tuple[Reason, ...]], ...]  # every other backend, ranking order
    interpreted_here: frozenset[str] = frozenset()  # backends that would run interpreted

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def requested(self) -> str:
        return self.deployment.backend

    @property
    def interpreted(self) -> bool:
        """True when the selected backend runs through Triton's CPU interpreter here."""
        return self.name in self.interpreted_here

    def log_line(self) -> str:
        """Selected (and whether interpreted), why, and each other backend with its reasons."""
        label = (
            f"{self.name} (interpreted: Triton's CPU interpreter, slow)"
            if self.interpreted
            else self.name
        )
        if self.how == EXPLICIT:
            why = "requested explicitly"
        else:
            why = "auto: the fastest backend that runs here"
            demoted = [n for n, r in self.others if not r and n in self.interpreted_here]
            if demoted:
                why += f"; {demoted[0]} would run interpreted on this cpu (slower)"
        not_chosen = "; ".join(
            f"{name} ({', '.join(map(str, reasons)) or self._passing_note(name)})"
            for name, reasons in self.others
        )
        return (
            f"moe backend for {self.deployment.name}: selected {label}, {why}; "
            f"not chosen: {not_chosen or 'none (the only backend)'}"
        )

    def _passing_note(self, name: str) -> str:
        # A backend with no reason was passed over only by the request or the ranking.
        if self.how == EXPLICIT:
            return "runs, not requested"
        if name in self.interpreted_here:
            return "runs, but interpreted here: slower"
        return f"runs, ranked below {self.name}"


def runs_interpreted(cap: Capabilities, deployment: Deployment) -> bool:
    """True when a backend of record `cap` would run through Triton's interpreter here."""
    return deployment.device.kind == "cpu" and cap.cpu_needs_interpreter


def ranking(deployment: Deployment, registry: Mapping[str, Backend]) -> list[str]:
    """Backend names by expected speed on the deployment's device: registry order, with the
    ones that would run interpreted after the native ones (a stable sort keeps the order
    within each group)."""
    return sorted(registry, key=lambda n: runs_interpreted(registry[n].capabilities, deployment))


def default_registry() -> Mapping[str, Backend]:
    from .backends.registry import REGISTRY

    return REGISTRY


def evaluate(
    deployment: Deployment, registry: Mapping[str, Backend] | None = None
) -> dict[str, list[Reason]]:
    """name -> reasons (empty = accepts), for every backend, in ranking order (`ranking`)."""
    registry = default_registry() if registry is None else registry
    return {
        name: check(registry[name].capabilities, deployment)
        for name in ranking(deployment, registry)
    }


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
    interpreted = frozenset(
        n for n in registry if runs_interpreted(registry[n].capabilities, deployment)
    )
    selection = Selection(registry[chosen], deployment, how, others, interpreted)
    log.info(selection.log_line())
    return selection
