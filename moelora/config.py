"""Frozen configuration dataclasses, one concern each, and `from_hf`: the one parser of
Hugging Face config.json files.

Legend (SPEC.md): E experts, K top-k, H hidden size, I expert intermediate size,
R max LoRA rank, L adapter slots.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .activations import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, Activation
from .errors import ConfigError
from .hf_keys import hf_fields
from .quantization import QuantConfig, from_hf_quantization
from .routing import RoutingConfig, RoutingMethod

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def parse_dtype(value: str | torch.dtype, key: str = "dtype") -> torch.dtype:
    """'bfloat16' / 'bf16' / torch.bfloat16 -> torch.bfloat16; raises ConfigError otherwise."""
    if isinstance(value, torch.dtype):
        if value in DTYPES.values():
            return value
    elif str(value).lower() in DTYPES:
        return DTYPES[str(value).lower()]
    raise ConfigError(key, value, "one of bfloat16, float16, float32", "pick a supported dtype")


@dataclass(frozen=True)
class MoEShape:
    """The expert computation: w13 [E, S*I, H], w2 [E, H, I] (S = 2 gated, 1 non-gated)."""

    num_experts: int  # E
    top_k: int  # K
    hidden_size: int  # H
    intermediate_size: int  # I
    activation: Activation
    has_bias: bool = False
    dtype: torch.dtype = torch.bfloat16
    swiglu_alpha: float = SWIGLUOAI_ALPHA
    swiglu_limit: float = SWIGLUOAI_LIMIT

    def __post_init__(self) -> None:
        for key in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(key, value, "a positive integer")
        # Normalise on construction: a stored string would break every later consumer.
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        try:
            object.__setattr__(self, "activation", Activation(self.activation))
        except ValueError:
            names = ", ".join(a.value for a in Activation)
            raise ConfigError("activation", self.activation, f"one of {names}") from None
        if self.top_k > self.num_experts:
            raise ConfigError(
                "top_k", self.top_k, f"at most num_experts = {self.num_experts}", "lower top_k"
            )

    @property
    def w13_rows(self) -> int:
        """S * I: rows of w13 per expert."""
        return self.activation.width_factor * self.intermediate_size


class AddInputs(str, enum.Enum):
    """How the LoRA-delta operation treats its output buffer (SPEC.md `add_inputs`)."""

    ADD = "add"  # out += delta
    OVERWRITE = "overwrite"  # out = delta


# Module names that put LoRA on the routed experts (per-expert and fused forms).
# PEFT's "all-linear" is counted too: on models with per-expert Linear modules it reaches the
# experts, so it must not drop the LoRA requirement.
EXPERT_TARGETS = frozenset(
    {"experts", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "gate_up_proj", "all-linear"}
)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA settings. `targets` are module names; LoRA reaches the experts only if one is
    an expert target (LoRA on attention alone puts no LoRA requirement on the MoE layer).

    num_slots (L) and max_rank (R) are what vLLM's CLI calls --max-loras and
    --max-lora-rank; the commands translate those flags at their edge."""

    enabled: bool = False
    max_rank: int = 16  # R
    num_slots: int = 1  # L
    targets: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    add_inputs: AddInputs = AddInputs.ADD

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):  # "down_proj" must not become ('d', 'o', ...)
            object.__setattr__(self, "targets", (self.targets,))
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.enabled:
            if self.max_rank < 1:
                raise ConfigError("max_rank", self.max_rank, "a positive integer")
            if self.num_slots < 1:
                raise ConfigError("num_slots", self.num_slots, "a positive integer")

    @property
    def on_experts(self) -> bool:
        return self.enabled and any(_targets_experts(t) for t in self.targets)


# Module paths of routed experts as PEFT sees them (per-expert Linear and fused forms), for
# targets written as regexes (PEFT full-matches a string target_modules against such paths).
_EXPERT_PATHS = tuple(
    f"model.layers.0.{block}.experts{leaf}"
    for block in ("mlp", "block_sparse_moe", "feed_forward", "mixer")
    for leaf in ("", ".0.gate_proj", ".0.up_proj", ".0.down_proj", ".0.w1", ".0.w2", ".0.w3")
)


def _targets_experts(target: str) -> bool:
    """True if a LoRA target (a module name, or a PEFT regex) can reach the routed experts."""
    if target.split(".")[-1] in EXPERT_TARGETS:
        return True
    if not any(c in target for c in "\\^$*+?()[]{}|"):
        return False
    try:
        return any(re.fullmatch(target, path) for path in _EXPERT_PATHS)
    except re.error:
        return True  # unreadable pattern: assume it may reach the experts (the safe side)


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout: tensor parallel size, expert parallel size, fully sharded LoRA.

    Fully sharded LoRA splits each expert's LoRA over the TP group. At tp = 1 (expert
    parallel or not) that group is one rank and there is nothing to split: the flag is
    accepted as a no-op, as vLLM does, and stored as False, so that every consumer (the
    oracle, moelora.parallel) sees the layout that runs. `moelora plan` notes it.
    """

    tp: int = 1
    ep: int = 1
    fully_sharded_loras: bool = False

    def __post_init__(self) -> None:
        for attr, key, flag in (
            ("tp", "tensor_parallel_size", "-tp"),
            ("ep", "expert_parallel_size", "-ep"),
        ):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(key, value, "a positive integer", f"pass {flag} 1 or more")
        if self.tp == 1:
            object.__setattr__(self, "fully_sharded_loras", False)


@dataclass(frozen=True)
class DeviceFacts:
    """What the hardware offers. Filled by moelora.device (probe) or by a named target."""

    kind: str  # "cuda" or "cpu"
    name: str
    compute_capability: tuple[int, int] | None = None
    packages: frozenset[str] = frozenset()
    interpreted: bool = False  # Triton kernels run through TRITON_INTERPRET=1


@dataclass(frozen=True)
class ModelConfig:
    """One model's MoE layers: shape, routing and where they sit."""

    name: str
    model_type: str
    shape: MoEShape
    routing: RoutingConfig
    num_layers: int
    moe_layers: tuple[int, ...] = field(default=())
    quantization: QuantConfig = field(default_factory=QuantConfig)  # the experts' storage

    def __post_init__(self) -> None:
        if self.routing.method is RoutingMethod.LLAMA4 and self.shape.top_k != 1:
            raise ConfigError(
                "num_experts_per_tok", self.shape.top_k, "1 for llama4 routing",
                "set num_experts_per_tok to 1 (Llama 4 sends each token to one routed expert)",
            )  # fmt: skip
        experts, groups = self.shape.num_experts, self.routing.n_group
        # DeepSeek-V3 scores a group by the sum of its top-2 experts: at least 2 per group.
        least = 2 if self.routing.method is RoutingMethod.DEEPSEEK_V3 else 1
        fits = [d for d in range(1, experts + 1) if experts % d == 0 and experts // d >= least]
        if experts % groups:
            raise ConfigError(
                "n_group", groups, f"a divisor of the {experts} experts",
                f"set n_group to one of {fits} (num_experts / n_group experts per group)",
            )  # fmt: skip
        per_group = experts // groups
        if per_group < least:
            raise ConfigError(
                "n_group", groups,
                f"at most {experts // least} groups of the {experts} experts: at least 2 "
                "experts per group (a group's score is the sum of its top-2 experts)",
                f"set n_group to one of {fits}",
            )  # fmt: skip
        if self.routing.method in (RoutingMethod.DEEPSEEK_V2, RoutingMethod.DEEPSEEK_V3):
            if self.routing.topk_group * per_group < self.shape.top_k:
                need = -(-self.shape.top_k // per_group)
                raise ConfigError(
                    "topk_group", self.routing.topk_group,
                    f"groups holding at least top_k = {self.shape.top_k} experts "
                    f"({per_group} experts per group)",
                    f"set topk_group to at least {need}, or n_group lower",
                )  # fmt: skip


def from_hf(config: dict[str, Any] | str | Path, name: str | None = None) -> ModelConfig:
    """Parse a Hugging Face config.json (dict or path) into a ModelConfig."""
    if isinstance(config, (str, Path)):
        path = Path(config)
        if not path.is_file():
            raise ConfigError(
                "config path",
                str(path),
                "an existing config.json file",
                "pass a preset (`moelora presets`), a config.json path or a model directory",
            )
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(
                "config path", str(path), f"valid JSON ({err})", "fix the file's JSON syntax"
            ) from None
        name = name or path.parent.name or path.stem
    if not isinstance(config, dict):
        raise ConfigError("config", type(config).__name__, "a dict parsed from config.json")
    shape, model = hf_fields(config, name)
    shape["dtype"] = parse_dtype(shape["dtype"], "dtype")
    model["quantization"] = from_hf_quantization(model["quantization"])
    return ModelConfig(shape=MoEShape(**shape), **model)
