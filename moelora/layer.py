"""The MoE-LoRA layer: owns one layer type's expert weights and deployment, asks the oracle
once (at construction, before any forward) which backend runs it, then calls that backend.

The layer never chooses a backend itself: `oracle.select` does, and its verdict is final.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import Tensor

from .backends.base import Backend
from .call import MoECall
from .comm import LoRAComm
from .config import AddInputs
from .deployment import Deployment, LoRASharding
from .errors import InputError
from .layer_checks import (
    check_bank,
    check_batch,
    check_experts,
    check_values,
    resolve_add_inputs,
)
from .oracle import Selection, select
from .quant.fp8_experts import FP8ExpertWeights
from .weights import ExpertWeights, LoRABank


class MoELoRALayer:
    """y [T, H] = the routed experts of SPEC.md with per-token LoRA, on the selected backend."""

    def __init__(
        self,
        deployment: Deployment,
        experts: ExpertWeights | FP8ExpertWeights,
        *,
        registry: Mapping[str, Backend] | None = None,
        check_values: bool = True,
        selection: Selection | None = None,
    ) -> None:
        """experts: this process's weights, w13 [E_l, S*I_p, H], w2 [E_l, H, I_p] (the whole
        layer when tp = ep = 1). check_values: also check expert ids and slots (a GPU sync;
        always skipped inside CUDA-graph capture). The transformers path turns it off: its
        ids come from the model's own router and its slots from the RowAdapters, which hand
        out only slots the SlotManager holds, and a sync per layer per step would stall
        decoding; the kernels still treat a slot >= L as no adapter. selection: the oracle's verdict for this
        very deployment, when many layers of one type share it (asked once, logged once)."""
        self.deployment = deployment
        if selection is None:
            selection = select(deployment, registry)  # raises on refusal
        elif selection.deployment != deployment:
            raise InputError(
                "selection",
                f"the oracle's verdict for {selection.deployment.name}",
                "the verdict for this layer's own deployment",
                "pass the Selection that oracle.select returned for this deployment",
            )
        self.selection: Selection = selection
        # What this rank holds: I_p intermediate units of E_l experts.
        self.shape = dataclasses.replace(
            deployment.shape, intermediate_size=deployment.intermediate_per_partition
        )
        check_experts(experts, self.shape, deployment.local_experts, deployment.quantization)
        self.experts = experts
        self.check_values = check_values

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
        add_inputs: AddInputs | None = None,
        lora_comm: LoRAComm | None = None,
    ) -> Tensor:
        """x [T, H]; topk_ids [T, K] int32; topk_weights [T, K] fp32; token_slots [T] int32
        (-1 = base model); lora: the slot bank of this layer (e.g. a SlotManager snapshot).
        add_inputs: how y goes into `out`; default and only accepted value when LoRA is on:
        the deployment's (the mode the oracle checked). lora_comm: fully sharded LoRA's
        collectives (moelora.parallel passes it)."""
        mode = resolve_add_inputs(self.deployment, add_inputs)
        weights_on_input = self.deployment.routing.method.weights_on_input
        call = MoECall(
            x, topk_ids, topk_weights, token_slots, lora, weights_on_input, lora_comm, out, mode
        )
        return self.run(call)

    def run(self, call: MoECall) -> Tensor:
        """forward on a built record (the parallel layer builds its own): checked against
        the deployment here, once, then handed to the backend unchanged."""
        self._check(call)
        x = call.x
        if call.num_tokens == 0:  # nothing to compute; kernels need at least one token
            return x.new_zeros(0, x.shape[1]) if call.out is None else call.out
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if call.lora is not None and x.is_cuda and not capturing:  # banks from a loader's stream
            for t in (call.lora.w13_a, call.lora.w13_b, call.lora.w2_a, call.lora.w2_b):
                t.record_stream(torch.cuda.current_stream())
        return self.selection.backend.forward(call, self.experts, self.shape)

    def _check(self, call: MoECall) -> None:
        """Everything the oracle judged must be what runs."""
        dep, lora = self.deployment, call.lora
        fully_sharded = dep.lora_sharding is LoRASharding.FULLY_SHARDED
        if (call.lora_comm is not None) != (fully_sharded and lora is not None):
            raise InputError(
                "lora_comm",
                "given" if call.lora_comm is not None else None,
                "a LoRAComm exactly when the deployment is fully sharded and lora is given "
                "(use moelora.parallel.ParallelMoELoRALayer)",
            )
        if lora is not None and not dep.lora.on_experts:
            raise InputError(
                "lora",
                "a LoRA bank",
                "None: this deployment declared no LoRA on the experts "
                "(enable LoRA with an expert target module to serve adapters here)",
            )
        if lora is not None and call.token_slots is None:
            raise InputError("token_slots", None, "a [T] int32 slot per token when lora is given")
        if call.weights_on_input != dep.routing.method.weights_on_input:
            raise InputError(
                "weights_on_input",
                call.weights_on_input,
                f"{dep.routing.method.weights_on_input}, as the deployment's routing says",
            )
        if call.out is not None:  # the mode the oracle checked (forward resolved it so)
            resolve_add_inputs(dep, call.add_inputs)
        check_batch(call, self.shape, self.experts.w13.device)
        if lora is not None:
            check_bank(lora, dep)
        capturing = call.x.is_cuda and torch.cuda.is_current_stream_capturing()
        if self.check_values and not capturing:
            check_values(call, dep.local_experts, foreign_ids=dep.parallel.ep > 1)

    __call__ = forward


def to_device(
    experts: ExpertWeights, device: torch.device | str, dtype: torch.dtype
) -> ExpertWeights:
    """A copy of the weights on `device` in `dtype` (biases too)."""
    move = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return ExpertWeights(move(experts.w13), move(experts.w2), move(experts.b13), move(experts.b2))
