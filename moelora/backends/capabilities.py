"""What a backend can run, as data: the `Capabilities` record, the typed `Reason`, and the
`Validation` runs that back the record on real hardware.

Each backend module declares one `Capabilities` beside its code; `checks.check` reads it
against a `Deployment`. Every field is required, so a record states each fact once and
explicitly (no permissive defaults to over-claim by omission). The one default,
`validated_on=()`, under-claims: "never validated anywhere".
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..activations import Activation
from ..config import AddInputs
from ..deployment import LoRASharding, ParallelMode
from ..quantization import Quantization
from ..routing import RoutingMethod


class Gating(str, enum.Enum):
    """Whether w13 holds a gate and an up projection (S = 2) or one projection (S = 1)."""

    GATED = "gated"
    NON_GATED = "non_gated"

    @staticmethod
    def of(activation: Activation) -> Gating:
        return Gating.GATED if activation.is_gated else Gating.NON_GATED


ALL_DEVICES = frozenset({"cuda", "cpu"})
ALL_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})
ALL_ACTIVATIONS = frozenset(Activation)
ALL_GATING = frozenset(Gating)
ALL_ROUTING = frozenset(RoutingMethod)
ALL_PARALLEL = frozenset(ParallelMode)
ALL_ADD_INPUTS = frozenset(AddInputs)
# Base experts stored in the serving dtype only (no quantized format).
FULL_PRECISION_ONLY: Mapping[Quantization, tuple[int, int] | None] = MappingProxyType(
    {Quantization.NONE: None}
)
EVERY_LORA_SHARDING: Mapping[LoRASharding, frozenset[AddInputs]] = MappingProxyType(
    dict.fromkeys(LoRASharding, ALL_ADD_INPUTS)
)


@dataclass(frozen=True)
class Reason:
    """One failed capability: `field` of the deployment had `value`; the backend `needed` ..."""

    field: str
    value: object  # a plain str / int / bool / None, so that it prints and serialises as is
    needed: str

    def __str__(self) -> str:
        return f"{self.field} = {self.value}: needs {self.needed}"

    def as_dict(self) -> dict[str, object]:
        return {"field": self.field, "value": self.value, "needed": self.needed}


@dataclass(frozen=True)
class Validation:
    """One passing `moelora validate` run (or test suite) behind a record: where it ran, in
    which dtypes, when, what it ran and where its log is. What a record allows (sm80+, say)
    is what the code supports; these are the machines it has actually been checked on."""

    device: str  # "NVIDIA H200", or "cpu" for the test suite under the Triton interpreter
    kind: str  # "cuda" or "cpu"
    compute_capability: tuple[int, int] | None  # cuda only
    dtypes: frozenset[torch.dtype]
    date: str  # ISO date of the run, or "every commit" for the test suite
    result: str  # the command and its pass count, e.g. "moelora validate ...: 110/110 pass"
    source: str  # where the log is kept (a docs/history/benchmarks.md entry, or the test files)
    # the experts' storage formats the run covered (the safe default: full precision only)
    quantizations: frozenset[Quantization] = frozenset({Quantization.NONE})


@dataclass(frozen=True)
class Capabilities:
    """Everything one backend supports. None in a limit means "no limit"."""

    # Hardware and software.
    devices: frozenset[str]  # "cuda", "cpu"
    min_compute_capability: tuple[int, int] | None  # cuda only
    max_compute_capability: tuple[int, int] | None  # cuda only, inclusive
    cpu_needs_interpreter: bool  # on cpu, Triton kernels need TRITON_INTERPRET=1
    packages: frozenset[str]  # importable packages the backend needs
    # The computation.
    dtypes: frozenset[torch.dtype]
    activations: frozenset[Activation]
    gating: frozenset[Gating]
    routing_methods: frozenset[RoutingMethod]
    expert_bias: bool  # b13 / b2 (gpt-oss)
    # Storage format of the base experts -> the minimum compute capability it needs on cuda
    # (None: the record's own minimum); a format absent = unsupported.
    quantizations: Mapping[Quantization, tuple[int, int] | None]
    # Parallel layout.
    parallel_modes: frozenset[ParallelMode]
    # LoRA on the experts.
    lora: bool
    runs_without_lora: bool  # False for a LoRA-only kernel
    max_rank: int | None  # R, the largest max_rank accepted
    max_slots: int | None  # L, the largest num_slots accepted
    lora_add_inputs: Mapping[LoRASharding, frozenset[AddInputs]]  # sharding absent = unsupported
    # Shape rules.
    intermediate_align: int  # I_p % n == 0
    hidden_align: int  # H % n == 0
    max_experts: int | None  # E
    max_groups: int | None  # groups per grouped GEMM (E_l), inclusive
    # Runtime.
    cuda_graph_safe: bool
    # Where the record has been checked on real hardware; () = nowhere (the safe default).
    validated_on: tuple[Validation, ...] = ()

    def __post_init__(self) -> None:
        # A malformed record is a bug in a backend module, caught when it is imported.
        for key in ("intermediate_align", "hidden_align"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"Capabilities.{key} must be a positive int")
        for key in ("max_rank", "max_slots", "max_experts", "max_groups"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"Capabilities.{key} must be None or a positive int")
        object.__setattr__(self, "lora_add_inputs", MappingProxyType(dict(self.lora_add_inputs)))
        object.__setattr__(self, "quantizations", MappingProxyType(dict(self.quantizations)))
        object.__setattr__(self, "validated_on", tuple(self.validated_on))
