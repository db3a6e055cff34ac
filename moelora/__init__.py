"""moelora: Mixture-of-Experts layers with many LoRA adapters at once."""

from importlib import metadata as _metadata

try:  # the installed distribution's version (pyproject.toml), one source of truth
    __version__ = _metadata.version("moelora")
except _metadata.PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"

from .activations import Activation, apply_activation
from .config import (
    AddInputs,
    DeviceFacts,
    LoRAConfig,
    ModelConfig,
    MoEShape,
    ParallelConfig,
    from_hf,
)
from .deployment import Deployment
from .errors import AdapterError, ConfigError, InputError, MoeloraError, UnsupportedDeploymentError
from .layer import MoELoRALayer
from .lora import SlotManager, load_adapter
from .oracle import Selection, select
from .presets import PRESETS, load_preset, resolve_model
from .reference import moe_lora_reference
from .routing import RoutingConfig, RoutingMethod, route
from .weights import ExpertWeights, LoRABank, random_expert_weights, random_lora_bank

__all__ = [
    "PRESETS",
    "Activation",
    "AdapterError",
    "AddInputs",
    "ConfigError",
    "Deployment",
    "DeviceFacts",
    "ExpertWeights",
    "InputError",
    "LoRABank",
    "LoRAConfig",
    "MoELoRALayer",
    "MoEShape",
    "ModelConfig",
    "MoeloraError",
    "ParallelConfig",
    "RoutingConfig",
    "RoutingMethod",
    "Selection",
    "SlotManager",
    "UnsupportedDeploymentError",
    "__version__",
    "apply_activation",
    "from_hf",
    "load_adapter",
    "load_preset",
    "moe_lora_reference",
    "random_expert_weights",
    "random_lora_bank",
    "resolve_model",
    "route",
    "select",
]
