"""The MoE-LoRA layer: owns one layer type's expert weights and deployment, asks the oracle
once (at construction, before any forward) which backend runs it, then calls that backend.

The layer never chooses a backend itself: `oracle.select` does, and its verdict is final.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from .backends.base import Backend
from .config import AddInputs, MoEShape
from .deployment import Deployment, LoRASharding
from .errors import InputError
from .oracle import Selection, select
from .reference import LoRAComm
from .weights import ExpertWeights, LoRABank


class MoELoRALayer:
    """y [T, H] = the routed experts of SPEC.md with per-token LoRA, on the selected backend."""

    def __init__(
        self,
        deployment: Deployment,
        experts: ExpertWeights,
        *,
        registry: Mapping[str, Backend] | None = None,
        shape: MoEShape | None = None,
    ) -> None:
        """shape: the shape of the weights this layer holds, when it is one rank's shard
        (moelora.parallel passes I_p); default the deployment's."""
        self.deployment = deployment
        self.selection: Selection = select(deployment, registry)  # raises on refusal
        self.experts = experts
        self.shape = shape or deployment.shape

    @property
    def backend_name(self) -> str:
        return self.selection.name

    def forward(
        self,
        x: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        token_slots: Tensor | None = None,
        lora: LoRABank | None = None,
        *,
        out: Tensor | None = None,
        add_inputs: AddInputs = AddInputs.OVERWRITE,
        lora_comm: LoRAComm | None = None,
    ) -> Tensor:
        """x [T, H]; topk_ids [T, K] int32; topk_weights [T, K] fp32; token_slots [T] int32
        (-1 = base model); lora: the slot bank of this layer (e.g. a SlotManager snapshot).
        lora_comm: fully sharded LoRA's collectives (moelora.parallel passes it)."""
        fully_sharded = self.deployment.lora_sharding is LoRASharding.FULLY_SHARDED
        if (lora_comm is not None) != (fully_sharded and lora is not None):
            raise InputError(
                "lora_comm",
                "given" if lora_comm is not None else None,
                "a LoRAComm exactly when the deployment is fully sharded and lora is given "
                "(use moelora.parallel.ParallelMoELoRALayer)",
            )
        if lora is not None and not self.deployment.lora.on_experts:
            raise InputError(
                "lora",
                "a LoRA bank",
                "None: this deployment declared no LoRA on the experts "
                "(enable LoRA with an expert target module to serve adapters here)",
            )
        if lora is not None and token_slots is None:
            raise InputError("token_slots", None, "a [T] int32 slot per token when lora is given")
        shape = self.shape
        if x.dtype != shape.dtype:
            raise InputError("x", f"dtype {x.dtype}", f"{shape.dtype} (the deployment's dtype)")
        return self.selection.backend.forward(
            x,
            topk_ids,
            topk_weights,
            token_slots,
            self.experts,
            lora,
            shape,
            weights_on_input=self.deployment.routing.method.weights_on_input,
            out=out,
            add_inputs=add_inputs,
            lora_comm=lora_comm,
        )

    __call__ = forward


def to_device(
    experts: ExpertWeights, device: torch.device | str, dtype: torch.dtype
) -> ExpertWeights:
    """A copy of the weights on `device` in `dtype` (biases too)."""
    move = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return ExpertWeights(move(experts.w13), move(experts.w2), move(experts.b13), move(experts.b2))
