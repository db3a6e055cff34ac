"""Test-only backends and a deployment builder for the oracle tests.

None of these is registered in moelora; tests pass them to select(registry=...) or
monkeypatch them into REGISTRY for one test.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moelora.activations import Activation
from moelora.backends.capabilities import ALL_DEVICES, Capabilities, Gating
from moelora.backends.reference import CAPABILITIES as REFERENCE_CAPS
from moelora.config import AddInputs, LoRAConfig, ParallelConfig
from moelora.deployment import AUTO, Deployment, LoRASharding
from moelora.device import target
from moelora.presets import load_preset


@dataclass(frozen=True)
class StubBackend:
    """A capability record with a name; forward is never reached by oracle tests."""

    name: str
    capabilities: Capabilities

    def forward(self, *args, **kwargs):
        raise AssertionError("test double: only its capability record is used; never run")


# Mimics the vendor kernel of SPEC.md "Why it exists": compute capability 10.x only, gated
# silu only, I_p % 128 == 0, LoRA only with add_inputs=False (OVERWRITE), hence never under
# fully sharded LoRA. Faster than triton, so ranked first when registered.
MIMIC = StubBackend(
    "mimic",
    dataclasses.replace(
        REFERENCE_CAPS,
        devices=frozenset({"cuda"}),
        min_compute_capability=(10, 0),
        max_compute_capability=(10, 9),
        dtypes=frozenset({torch.bfloat16}),
        activations=frozenset({Activation.SILU}),
        gating=frozenset({Gating.GATED}),
        expert_bias=False,
        lora_add_inputs={
            LoRASharding.UNSHARDED: frozenset({AddInputs.OVERWRITE}),
            LoRASharding.TP: frozenset({AddInputs.OVERWRITE}),
        },
        intermediate_align=128,
        cuda_graph_safe=True,
    ),
)

# What SPEC.md asks of the triton backend (every activation, dtype and sharding mode, both
# add_inputs modes, sm80+, interpreted on cpu); used where the real one is not registered yet.
TRITON_LIKE = StubBackend(
    "triton",
    dataclasses.replace(
        REFERENCE_CAPS,
        devices=ALL_DEVICES,
        min_compute_capability=(8, 0),
        cpu_needs_interpreter=True,
        packages=frozenset({"torch", "triton"}),
        cuda_graph_safe=True,
    ),
)

# A LoRA-only kernel (SPEC.md failure 3): it asserts when no LoRA context exists.
LORA_ONLY = StubBackend(
    "lora_only",
    dataclasses.replace(REFERENCE_CAPS, runs_without_lora=False, cuda_graph_safe=True),
)

ATTENTION_ONLY = ("q_proj", "v_proj")


def deploy(
    model: str = "tiny",
    device: str = "h200",
    *,
    tp: int = 1,
    ep: int = 1,
    fully_sharded: bool = False,
    lora: bool = False,
    targets: tuple[str, ...] | None = None,
    rank: int = 16,
    loras: int = 4,
    add_inputs: AddInputs = AddInputs.ADD,
    dtype: str = AUTO,
    cuda_graphs: bool = False,
    backend: str = AUTO,
) -> Deployment:
    """A Deployment of a preset on a named target (keyword knobs for case tables)."""
    lora_cfg = LoRAConfig(
        enabled=lora,
        max_rank=rank,
        num_slots=loras,
        targets=targets or LoRAConfig().targets,
        add_inputs=add_inputs,
    )
    return Deployment.for_model(
        load_preset(model),
        dtype=dtype,
        device=target(device),
        parallel=ParallelConfig(tp, ep, fully_sharded),
        lora=lora_cfg,
        cuda_graphs=cuda_graphs,
        backend=backend,
    )


def fields(reasons) -> set[str]:
    return {r.field for r in reasons}
