"""What an adapter changes, judged before it is served: no silent no-op adapters.

Three cases (SPEC.md, Adapters: an adapter that would change nothing the deployment serves
is refused, never silently ignored):

1. The config targets the routed experts, the file holds no expert tensors (e.g. PEFT's
   `target_modules=["down_proj"]` on a model whose experts are fused 3-D parameters, which
   PEFT's Linear matching does not reach): refused, naming the targets.
2. No expert tensors at all, and the caller serves only the experts (`serves_non_expert`
   False, the default: moelora's MoE layers alone): refused, naming what it targets. A
   caller that applies the other modules elsewhere (the transformers integration) passes
   True and gets the adapter with no expert layers.
3. Every served delta is zero (PEFT initialises lora_B to zeros; an adapter saved before
   training): loaded, with one warning.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from ..config import LoRAConfig
from ..errors import AdapterError
from .formats import Projection, peft_name

# Fused expert parameters PEFT's target_parameters names (gate_up_proj; non-gated up_proj).
_FUSED_PARAMS = frozenset({"gate_up_proj", "up_proj", "down_proj"})
# The "changes everything" targets: they name no module, so nothing can be missing for them.
_ANY_LINEAR = "all-linear"


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]


def _reaches_experts(target: str) -> bool:
    """A target_modules entry that can name a routed expert module (a name or a regex)."""
    return target != _ANY_LINEAR and LoRAConfig(enabled=True, targets=(target,)).on_experts


def _matches(target: str, module: str, as_regex: bool) -> bool:
    """PEFT's matching: a string target_modules is a full-match regex; a list entry matches
    a module name equal to it or ending in '.' + it."""
    if as_regex:
        try:
            return re.fullmatch(target, module) is not None
        except re.error:
            return True  # an unreadable pattern: never the reason for a refusal
    return module == target or module.endswith("." + target)


def unmatched_expert_targets(config: dict[str, Any], other_modules: Iterable[str]) -> list[str]:
    """Targets of adapter_config.json that name the routed experts and that no module of a
    file without expert tensors accounts for (a name PEFT matched elsewhere, e.g. the shared
    experts' down_proj on NemotronH, is accounted for)."""
    names = [peft_name(m) for m in other_modules]
    out = [
        t
        for t in _as_list(config.get("target_parameters"))
        if t.split(".")[-1] in _FUSED_PARAMS or "experts" in t.split(".")
    ]
    modules = config.get("target_modules")
    as_regex = isinstance(modules, str)
    for target in _as_list(modules):
        if _reaches_experts(target) and not any(_matches(target, n, as_regex) for n in names):
            out.append(target)
    return out


def check_serves(
    file: str, config: dict[str, Any], other_modules: tuple[str, ...], serves_non_expert: bool
) -> None:
    """Cases 1 and 2 for an adapter whose file holds no expert tensors."""
    missing = unmatched_expert_targets(config, other_modules)
    if missing:
        key = "target_parameters" if config.get("target_parameters") else "target_modules"
        raise AdapterError(
            file,
            key,
            f"targets {missing} on the routed experts, but no expert tensors in the file "
            f"({len(other_modules)} other modules)",
            "LoRA factors for the experts the config targets",
            "save the adapter from a PEFT model whose experts were adapted (fused 3-D experts "
            "need target_parameters, e.g. ['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'])",
        )
    if not serves_non_expert:
        example = ", ".join(other_modules[:3]) + (", ..." if len(other_modules) > 3 else "")
        raise AdapterError(
            file,
            "<targets>",
            f"no LoRA on the routed experts: it targets only {len(other_modules)} modules "
            f"outside them ({example}), which these MoE layers do not run",
            "LoRA factors on the routed experts",
            "load it where those modules are served (serves_non_expert=True, e.g. the "
            "transformers integration), or train the adapter on the experts",
        )


def _zero(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return t.abs().amax(dim=dims) == 0


def experts_delta_is_zero(projections: list[Projection]) -> bool:
    """True if B_e @ A_e is zero for every expert of every projection (a or b all zeros)."""
    return all(
        p.scale == 0 or bool((_zero(p.a, (1, 2)) | _zero(p.b, (1, 2))).all()) for p in projections
    )


def modules_delta_is_zero(tensors: dict[str, torch.Tensor]) -> bool:
    """True if every module's LoRA factors multiply to zero: some factor of each module (key
    prefix before '.lora_') is all zeros."""
    zero: dict[str, bool] = {}
    for key, t in tensors.items():
        module = key.split(".lora_")[0]
        zero[module] = zero.get(module, False) or bool(_zero(t.reshape(1, -1), (1,)).all())
    return all(zero.values())
