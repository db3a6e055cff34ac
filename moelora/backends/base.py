"""The backend contract: the `Backend` interface, plus the capability record and the one check
it is judged by (re-exported from capabilities.py and checks.py).

A backend module defines a module-level `BACKEND` (name, capabilities, forward) and is
listed once in registry.py. Backends never choose a backend: only moelora.oracle does.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from ..call import MoECall
from ..config import AddInputs, MoEShape
from ..weights import ExpertWeights
from .capabilities import Capabilities, Gating, Reason
from .checks import CHECKS, check, check_table

__all__ = [
    "CHECKS",
    "Backend",
    "Capabilities",
    "Gating",
    "Reason",
    "check",
    "check_table",
    "write_output",
]


@runtime_checkable
class Backend(Protocol):
    """One way to run the expert computation of SPEC.md."""

    name: str
    capabilities: Capabilities

    def forward(self, call: MoECall, experts: ExpertWeights, shape: MoEShape) -> Tensor:
        """y [T, H] in x's dtype, for one checked per-call record (call.py: x, top-k ids
        and weights, token slots, the bank, lora_comm, out), the local experts and their
        shape.

        call.out given: OVERWRITE writes y into it, ADD does out += y; returns out. out
        None: returns y. call.lora_comm: given exactly when the deployment is fully sharded
        and a bank is given (moelora.parallel): the bank then holds this process's shards and
        the backend runs the collectives of LoRAComm, the same calls in the same order on
        every process. A backend whose record refuses fully sharded LoRA raises InputError
        when given one.
        """
        ...


def write_output(y: Tensor, out: Tensor | None, add_inputs: AddInputs) -> Tensor:
    """Apply the `out` / `add_inputs` contract to a finished y [T, H] (shared by backends)."""
    if out is None:
        return y
    with torch.no_grad():
        if add_inputs is AddInputs.ADD:
            out.add_(y.to(out.dtype))
        else:
            out.copy_(y)
    return out
