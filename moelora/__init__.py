"""moelora: Mixture-of-Experts layers with many LoRA adapters at once."""

from importlib import metadata as _metadata

try:  # the installed distribution's version (pyproject.toml), one source of truth
    __version__ = _metadata.version("moelora")
except _metadata.PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"

from typing import TYPE_CHECKING

# The public names, each imported from its module on first use (PEP 562): `import moelora`
# stays cheap, so the command line can answer Ctrl-C with one line even while it loads.
_HOMES = {
    "Activation": "activations",
    "apply_activation": "activations",
    "AddInputs": "config",
    "DeviceFacts": "config",
    "LoRAConfig": "config",
    "ModelConfig": "config",
    "MoEShape": "config",
    "ParallelConfig": "config",
    "from_hf": "config",
    "Deployment": "deployment",
    "AdapterError": "errors",
    "ConfigError": "errors",
    "InputError": "errors",
    "MoeloraError": "errors",
    "UnsupportedDeploymentError": "errors",
    "MoELoRALayer": "layer",
    "SlotManager": "lora",
    "load_adapter": "lora",
    "Selection": "oracle",
    "select": "oracle",
    "PRESETS": "presets",
    "load_preset": "presets",
    "resolve_model": "presets",
    "moe_lora_reference": "reference",
    "RoutingConfig": "routing",
    "RoutingMethod": "routing",
    "route": "routing",
    "ExpertWeights": "weights",
    "LoRABank": "weights",
    "random_expert_weights": "weights",
    "random_lora_bank": "weights",
}

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
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
    from .errors import (
        AdapterError,
        ConfigError,
        InputError,
        MoeloraError,
        UnsupportedDeploymentError,
    )
    from .layer import MoELoRALayer
    from .lora import SlotManager, load_adapter
    from .oracle import Selection, select
    from .presets import PRESETS, load_preset, resolve_model
    from .reference import moe_lora_reference
    from .routing import RoutingConfig, RoutingMethod, route
    from .weights import ExpertWeights, LoRABank, random_expert_weights, random_lora_bank


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'moelora' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


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
