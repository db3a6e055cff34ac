"""A deployment: everything the oracle needs to decide which backend runs one MoE layer type.

Legend: E experts, E_l = E / ep local experts, H hidden, I intermediate, I_p = I / tp,
R max LoRA rank, L adapter slots.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import DeviceFacts, LoRAConfig, ModelConfig, MoEShape, ParallelConfig, parse_dtype
from .errors import ConfigError
from .quantization import QuantConfig, resolve_quantization
from .routing import RoutingConfig

AUTO = "auto"


class ParallelMode(str, enum.Enum):
    """How the experts are split across ranks."""

    SINGLE = "single"  # tp = ep = 1
    TP = "tp"  # tensor parallel only
    EP = "ep"  # expert parallel only
    TP_EP = "tp+ep"  # both


class LoRASharding(str, enum.Enum):
    """How the LoRA slot banks are split across tensor-parallel ranks (SPEC.md, parallel modes)."""

    UNSHARDED = "unsharded"  # tp = 1 (expert parallel slices on E only)
    TP = "tp"  # gate/up B split on I, down A split on I
    FULLY_SHARDED = "fully_sharded"  # gate/up A split on R, down B split on H


@dataclass(frozen=True)
class Deployment:
    """One MoE layer type as it will be served. `shape.dtype` is the serving dtype (the
    activations', the LoRA factors' and, unquantized, the experts').

    quantization: how the base experts are stored (--quantization; LoRA stays in dtype).
    backend: "auto" or the name of a registered backend (--moe-backend).
    """

    shape: MoEShape
    routing: RoutingConfig
    device: DeviceFacts
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    cuda_graphs: bool = False
    backend: str = AUTO
    name: str = "moe"
    quantization: QuantConfig = field(default_factory=QuantConfig)

    def __post_init__(self) -> None:
        self._check_split("tensor_parallel_size", self.parallel.tp, "intermediate_size", "I")
        self._check_split("expert_parallel_size", self.parallel.ep, "num_experts", "E")
        if self.lora_sharding is LoRASharding.FULLY_SHARDED and self.lora.on_experts:
            self._check_split("tensor_parallel_size", self.parallel.tp, "hidden_size", "H")
            if self.lora.max_rank % self.parallel.tp:
                raise ConfigError(
                    "max_rank",
                    self.lora.max_rank,
                    f"a multiple of tensor_parallel_size = {self.parallel.tp} "
                    "(fully sharded LoRA splits A on the rank)",
                    "raise --max-lora-rank or drop --fully-sharded-loras",
                )
        if self.quantization.method.is_fp8 and self.parallel.tp * self.parallel.ep > 1:
            raise ConfigError(
                "quantization",
                self.quantization.method.value,
                "FP8 experts on one process per layer (tp = ep = 1): the parallel layer "
                "shards serving-dtype experts only",
                "drop -tp / -ep, or serve the bf16 checkpoint (--quantization none)",
            )
        if self.cuda_graphs and self.device.kind != "cuda":
            raise ConfigError(
                "cuda_graphs", True, "a cuda device", f"use --enforce-eager on {self.device.kind}"
            )
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError("moe_backend", self.backend, "'auto' or a backend name")

    def _check_split(self, key: str, size: int, dim: str, letter: str) -> None:
        total = getattr(self.shape, dim)
        if total % size:
            raise ConfigError(
                key, size, f"a divisor of {letter} = {total} ({dim})", f"pick a divisor of {total}"
            )

    @classmethod
    def for_model(
        cls,
        model: ModelConfig,
        *,
        dtype: str | torch.dtype = AUTO,
        quantization: str | None = None,
        **kwargs: Any,
    ) -> Deployment:
        """A deployment of `model`'s MoE layers; dtype "auto" keeps the model's dtype;
        quantization None keeps the model's format (resolve_quantization reads the flag)."""
        shape = model.shape
        if dtype != AUTO:
            shape = dataclasses.replace(shape, dtype=parse_dtype(dtype))
        quant = resolve_quantization(quantization, model.quantization)
        return cls(
            shape=shape, routing=model.routing, name=model.name, quantization=quant, **kwargs
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.shape.dtype

    @property
    def intermediate_per_partition(self) -> int:
        """I_p = I / tp."""
        return self.shape.intermediate_size // self.parallel.tp

    @property
    def local_experts(self) -> int:
        """E_l = E / ep."""
        return self.shape.num_experts // self.parallel.ep

    @property
    def num_groups(self) -> int:
        """GEMM groups per grouped launch: one per local expert."""
        return self.local_experts

    @property
    def lora_on_experts(self) -> bool:
        """LoRA enabled AND targeting the experts; attention-only LoRA is no requirement here."""
        return self.lora.on_experts

    @property
    def parallel_mode(self) -> ParallelMode:
        tp, ep = self.parallel.tp > 1, self.parallel.ep > 1
        return {
            (False, False): ParallelMode.SINGLE,
            (True, False): ParallelMode.TP,
            (False, True): ParallelMode.EP,
            (True, True): ParallelMode.TP_EP,
        }[(tp, ep)]

    @property
    def lora_sharding(self) -> LoRASharding:
        if self.parallel.tp == 1:
            return LoRASharding.UNSHARDED
        if self.parallel.fully_sharded_loras:
            return LoRASharding.FULLY_SHARDED
        return LoRASharding.TP

    def describe(self) -> str:
        """One line: name, legend sizes, dtype, layout, LoRA, device."""
        s = self.shape
        lora = (
            f"lora R={self.lora.max_rank} L={self.lora.num_slots} {self.lora_sharding.value} "
            f"add_inputs={self.lora.add_inputs.value}"
            if self.lora_on_experts
            else "no expert lora"
        )
        return (
            f"{self.name}: E={s.num_experts} K={s.top_k} H={s.hidden_size} "
            f"I={s.intermediate_size} I_p={self.intermediate_per_partition} "
            f"{s.activation.value} {self.routing.method.value} {dtype_name(self.dtype)} "
            f"{quant_name(self.quantization)} "
            f"tp={self.parallel.tp} ep={self.parallel.ep} {lora} on {self.device.name} "
            f"cuda_graphs={self.cuda_graphs}"
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready facts (what `moelora plan --json` prints)."""
        s, lora = self.shape, self.lora
        return {
            "name": self.name,
            "num_experts": s.num_experts,
            "local_experts": self.local_experts,
            "top_k": s.top_k,
            "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size,
            "intermediate_per_partition": self.intermediate_per_partition,
            "activation": s.activation.value,
            "gated": s.activation.is_gated,
            "has_bias": s.has_bias,
            "routing": self.routing.method.value,
            "dtype": dtype_name(self.dtype),
            "quantization": self.quantization.method.value,
            "quantization_block": list(self.quantization.block),
            "tp": self.parallel.tp,
            "ep": self.parallel.ep,
            "fully_sharded_loras": self.parallel.fully_sharded_loras,
            "lora_enabled": lora.enabled,
            "lora_on_experts": self.lora_on_experts,
            "lora_targets": list(lora.targets),
            "max_lora_rank": lora.max_rank,
            "max_loras": lora.num_slots,
            "lora_add_inputs": lora.add_inputs.value,
            "device": self.device.name,
            "device_kind": self.device.kind,
            "compute_capability": _cc(self.device.compute_capability),
            "cuda_graphs": self.cuda_graphs,
            "requested_backend": self.backend,
        }


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def quant_name(quant: QuantConfig) -> str:
    """'experts none', 'experts fp8_block 128x128', 'experts fp8_channel'."""
    block = f" {quant.block[0]}x{quant.block[1]}" if quant.method.value == "fp8_block" else ""
    return f"experts {quant.method.value}{block}"


def _cc(capability: tuple[int, int] | None) -> str | None:
    return None if capability is None else f"{capability[0]}.{capability[1]}"
