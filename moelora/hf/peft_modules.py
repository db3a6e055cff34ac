"""The non-expert modules of an adapter (attention q/k/v/o, shared experts, dense MLPs, the
LM head), applied per row by PEFT's own LoRA layers.

PEFT already applies per-row LoRA on nn.Linear modules (`adapter_names`, "__base__" for a
row without); moelora owns the experts. So an adapter's non-expert factors are injected
into the model with `peft.inject_adapter_in_model` under a config that names exactly those
modules (never the experts: their delta is moelora's, applied once), and a forward
pre-hook on every PEFT LoRA layer passes the current call's per-row names (batch.py).
Outside a handle call no PEFT adapter is active: the model is the base model.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import AdapterError
from ..lora import formats
from ..lora.validate import check_tensor, lora_scale
from . import batch

_FACTOR = {"lora_A.weight": "A", "lora_B.weight": "B"}


@dataclass(frozen=True)
class NonExpertPart:
    """One adapter's non-expert factors: module path (in the model) -> (A [r, in], B [out, r])
    as saved by PEFT (unscaled; PEFT's layer applies its scale), and the PEFT config
    fields that decide ranks and scales."""

    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    config: dict[str, Any]

    @property
    def modules(self) -> list[str]:
        return sorted(self.factors)


def read_non_expert(
    file: str, config: dict[str, Any], tensors: dict[str, torch.Tensor], model: nn.Module
) -> NonExpertPart | None:
    """The non-expert factors of an adapter file, checked against `model` (every module must
    exist and be an nn.Linear, or a PEFT LoRA layer over one); None when there are none.
    Raises AdapterError naming the first module that cannot be applied, a factor that is not
    a finite float, or a rank that r / rank_pattern in adapter_config.json contradict."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if formats.classify(key) != "other":
            continue
        head, sep, tail = key.partition(".lora_")
        factor = _FACTOR.get(f"lora_{tail}") if sep else None
        if factor is None:
            raise AdapterError(
                file,
                key,
                "a non-expert entry that is not a LoRA A/B weight",
                "lora_A.weight / lora_B.weight factors",
                "train without DoRA, lora_bias, embeddings LoRA or modules_to_save",
            )
        pairs.setdefault(formats.peft_name(head), {})[factor] = t
    if not pairs:
        return None
    factors = {}
    for path, ab in sorted(pairs.items()):
        base = _linear(file, path, model)
        if set(ab) != {"A", "B"}:
            raise AdapterError(file, path, f"only lora_{next(iter(ab))}", "both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        want_a, want_b = (a.shape[0], base.in_features), (base.out_features, a.shape[0])
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise AdapterError(
                file,
                path,
                f"lora_A {list(a.shape)}, lora_B {list(b.shape)}",
                f"lora_A [r, {base.in_features}], lora_B [{base.out_features}, r]",
                "load the adapter for the model it was trained on",
            )
        for factor, t in (("lora_A", a), ("lora_B", b)):  # int8 / NaN refused, never cast
            check_tensor(file, f"{path}.{factor}.weight", t)
        lora_scale(file, config, path, a.shape[0], f"{path}.lora_A.weight")  # r / rank_pattern
        factors[path] = (a, b)
    return NonExpertPart(factors, config)


def _linear(file: str, path: str, model: nn.Module) -> nn.Linear:
    from peft.tuners.lora import LoraLayer

    try:
        module = model.get_submodule(path)
    except AttributeError:
        raise AdapterError(
            file,
            path,
            "a module this model does not have",
            f"a module of {type(model).__name__}",
            "load the adapter for the model it was trained on",
        ) from None
    if isinstance(module, LoraLayer):
        module = module.get_base_layer()
    if type(module) is not nn.Linear:
        raise AdapterError(
            file,
            path,
            f"LoRA on a {type(module).__name__}",
            "LoRA on the routed experts (moelora) or on nn.Linear modules (PEFT, per row)",
            "neither moelora nor PEFT can apply it per row: re-train without this module",
        )
    return module


class PeftModules:
    """The PEFT LoRA layers of one model: inject, fill, delete one adapter version."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def inject(self, name: str, part: NonExpertPart) -> None:
        """Create `name` on exactly part.modules and copy the factors in; on any failure the
        adapter is deleted again (the model is left as it was, bar empty LoRA wrappers)."""
        from peft import LoraConfig, inject_adapter_in_model

        cfg = part.config
        lora_config = LoraConfig(
            r=cfg["r"],
            lora_alpha=cfg.get("lora_alpha", cfg["r"]),
            use_rslora=bool(cfg.get("use_rslora", False)),
            rank_pattern=dict(cfg.get("rank_pattern") or {}),
            alpha_pattern=dict(cfg.get("alpha_pattern") or {}),
            target_modules=part.modules,
            lora_dropout=0.0,
            bias="none",
        )
        try:
            with warnings.catch_warnings():  # "already found a peft_config": on purpose
                warnings.simplefilter("ignore")
                inject_adapter_in_model(lora_config, self.model, adapter_name=name)
            with torch.no_grad():
                for path, (a, b) in part.factors.items():
                    layer = self.model.get_submodule(path)
                    self._fill(layer, name, path, a, b)
        except Exception:
            self.delete(name)
            raise
        self._deactivate_and_hook()

    def delete(self, name: str) -> None:
        from peft.tuners.lora import LoraLayer

        for module in self.model.modules():
            if isinstance(module, LoraLayer) and name in module.lora_A:
                module.delete_adapter(name)
        getattr(self.model, "peft_config", {}).pop(name, None)
        self._deactivate_and_hook()

    @staticmethod
    def _fill(layer, name: str, path: str, a: torch.Tensor, b: torch.Tensor) -> None:
        lora_a, lora_b = layer.lora_A[name].weight, layer.lora_B[name].weight
        if lora_a.shape != a.shape or lora_b.shape != b.shape:
            raise AdapterError(
                path,
                "rank",
                f"lora_A {list(a.shape)} in the file",
                f"lora_A {list(lora_a.shape)} from r / rank_pattern in adapter_config.json",
                "the config and the weights come from different adapters: save them together",
            )
        lora_a.copy_(a)
        lora_b.copy_(b)

    def _deactivate_and_hook(self) -> None:
        """No adapter active outside a handle call; every LoRA layer reads the call's names."""
        from peft.tuners.lora import LoraLayer

        for module in self.model.modules():
            if isinstance(module, LoraLayer):
                module.set_adapter([])
                if not getattr(module, "_moelora_hooked", False):
                    module.register_forward_pre_hook(_pass_adapter_names, with_kwargs=True)
                    module._moelora_hooked = True


def _pass_adapter_names(module, args, kwargs):
    """Forward pre-hook: the current call's per-row PEFT names as `adapter_names`."""
    rows = batch.current()
    if rows is None or not rows.peft_lora:
        return None
    x = args[0] if args else kwargs["x"]
    kwargs["adapter_names"] = rows.peft_names_for(x.shape[0])
    return args, kwargs
