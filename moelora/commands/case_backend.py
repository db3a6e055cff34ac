"""The backend one validate or bench case runs, chosen through the oracle for exactly that
case: a backend the oracle would refuse for it is never run (the refusal raises, naming
the failing capabilities)."""

from __future__ import annotations

import logging

from ..backends.base import Backend
from ..config import AddInputs, DeviceFacts, LoRAConfig, ModelConfig
from ..deployment import Deployment
from ..oracle import select


def case_backend(
    name: str,
    model: ModelConfig,
    device: DeviceFacts,
    *,
    adapters: int,
    max_rank: int,
    cuda_graphs: bool,
    quantization: str | None = None,
) -> Backend:
    """The backend `name` for `model`'s layer on `device` with `adapters` slots (0: no LoRA
    bank) of rank <= max_rank, replayed from CUDA graphs or not; quantization: the experts'
    storage flag (None: the model's own)."""
    lora = LoRAConfig(
        enabled=adapters > 0,
        max_rank=max_rank,
        num_slots=max(1, adapters),
        add_inputs=AddInputs.OVERWRITE,  # forward without `out` writes y
    )
    deployment = Deployment.for_model(
        model,
        device=device,
        lora=lora,
        cuda_graphs=cuda_graphs,
        backend=name,
        quantization=quantization,
    )
    oracle_log = logging.getLogger("moelora.oracle")
    level = oracle_log.level
    oracle_log.setLevel(logging.WARNING)  # one selection per case: keep the output readable
    try:
        return select(deployment).backend
    finally:
        oracle_log.setLevel(level)
