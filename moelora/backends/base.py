"""The backend contract: the `Backend` interface, plus the capability record and the one check
it is judged by (re-exported from capabilities.py and checks.py).

A backend module defines a module-level `BACKEND` (name, capabilities, forward) and is
listed once in registry.py. Backends never choose a backend: only moelora.oracle does.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from ..comm import LoRAComm
from ..config import AddInputs, MoEShape
from ..weights import ExpertWeights, LoRABank
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

    def forward(
        self,
        x: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        token_slots: Tensor | None,
        experts: ExpertWeights,
        lora: LoRABank | None,
        shape: MoEShape,
        *,
        weights_on_input: bool = False,
        out: Tensor | None = None,
        add_inputs: AddInputs = AddInputs.OVERWRITE,
        lora_comm: LoRAComm | None = None,
    ) -> Tensor:
        """y [T, H] in x's dtype.

        x [T, H]; topk_ids [T, K] int32; topk_weights [T, K] fp32; token_slots [T] int32
        (-1 = no adapter) or None. out [T, H] given: OVERWRITE writes y into it, ADD does
        out += y; returns out. out None: returns y.
        lora_comm: given exactly when the deployment is fully sharded and lora is given
        (moelora.parallel): lora then holds this rank's shards (w13_a [L, E, S, R/tp, H],
        w2_b [L, E, H/tp, R]) and the backend runs the collectives of LoRAComm, the same
        calls in the same order on every rank. A backend whose record refuses fully sharded
        LoRA raises InputError when given one.
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
