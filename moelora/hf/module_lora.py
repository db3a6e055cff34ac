"""The dense Linear modules of a model served with per-token LoRA by moelora: attention
q/k/v/o (and fused qkv), shared experts, dense MLP layers, the LM head, and the routers
(router_lora.py).

At attach, every module an adapter may target (`lora_target_modules`, default every
nn.Linear of the model and every router) gets a bank in the slot manager
(lora/module_banks.py) and a forward hook: output + dense_lora_delta(input, the call's
per-token slots, the bank). The
slots are the ones the experts read (current()); the banks are the manager's own
tensors, written under the same slot leases, so a call keeps the versions it started with
for every module. Outside a handle call, and in a call with no module LoRA, the hook
changes nothing. PEFT's files are read here; PEFT's modules are never injected.
Legend: T tokens, N in features, M out features, r rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import AdapterError, ConfigError
from ..lora import formats
from ..lora.module_banks import ModuleBanks, ModuleLoRA, ModuleShape, dense_lora_delta
from ..lora.rows import current
from ..lora.validate import check_tensor, lora_scale
from ..quant.module_fp8 import fp8_block
from .router_lora import serve_router

_FACTOR = {"lora_A.weight": "A", "lora_B.weight": "B"}
_BASE_WEIGHT = ".base_layer.weight"


def served_modules(
    model: nn.Module, names: Sequence[str] | None, routers: dict[str, nn.Module]
) -> dict[str, nn.Module]:
    """path -> module of every module attach() serves LoRA on: all of the model's plain
    nn.Linear modules, its block-scaled FP8 Linears (transformers' FP8Linear: the LoRA
    reads the unquantized input) and `routers` (names None), or those whose path equals or ends with
    ".name" for a name in `names` (PEFT's target_modules matching). A name matching none is
    refused."""
    candidates = {n: m for n, m in model.named_modules() if _linear(m)}
    candidates.update(routers)
    if names is None:
        return candidates
    if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(
            "lora_target_modules",
            repr(names),
            "a list of module names, or None for every Linear and router",
            "pass e.g. lora_target_modules=['q_proj', 'v_proj']",
        )
    chosen = {p: m for p, m in candidates.items() if any(_matches(p, n) for n in names)}
    unmatched = [n for n in names if not any(_matches(p, n) for p in candidates)]
    if unmatched:
        short = sorted({p.rsplit(".", 1)[-1] for p in candidates})
        raise ConfigError(
            "lora_target_modules",
            repr(unmatched[0]),
            f"the name of an nn.Linear or router of the model (e.g. {short})",
            "name the model's own Linear modules, as PEFT's target_modules does",
        )
    return chosen


def _linear(module: nn.Module) -> bool:
    """A Linear whose output a forward hook adds LoRA to: plain, or block-scaled FP8."""
    return type(module) is nn.Linear or fp8_block(module) is not None


def _matches(path: str, name: str) -> bool:
    return path == name or path.endswith("." + name)


def module_shapes(modules: dict[str, nn.Module], dtype: torch.dtype) -> dict[str, ModuleShape]:
    """The bank shape of each served module, from its weight [M, N]; its dtype the weight's,
    or the serving `dtype` for an FP8 Linear's (LoRA stays in the serving dtype)."""
    shapes = {}
    for path, m in modules.items():
        bank_dtype = dtype if fp8_block(m) is not None else m.weight.dtype
        shapes[path] = ModuleShape(
            m.weight.shape[1], m.weight.shape[0], m.weight.device, bank_dtype
        )
    return shapes


def read_module_factors(
    file: str,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    served: dict[str, nn.Module],
) -> dict[str, ModuleLoRA]:
    """The non-expert factors of an adapter file (path -> ModuleLoRA, scale folded into b),
    each checked against its served module (nn.Linear or router). Raises AdapterError naming the first module that
    cannot be served: not a LoRA A/B weight, not a served Linear, a missing half, a shape or a
    rank (r / rank_pattern) that disagrees, a factor that is not a finite float."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if formats.classify(key) != "other":
            continue
        if key.endswith(_BASE_WEIGHT):
            _check_saved_base(file, key, t, served)
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
    return {path: _module(file, config, path, ab, served) for path, ab in sorted(pairs.items())}


def _check_saved_base(file: str, key: str, t: torch.Tensor, served: dict[str, nn.Module]):
    """PEFT saves the LM head's base weight beside its LoRA factors (save_embedding_layers
    "auto"): accepted when it is the model's own weight, which moelora serves unchanged."""
    path = formats.peft_name(key.removesuffix(_BASE_WEIGHT))
    base = served.get(path)
    if base is None:
        raise _not_served(file, path)
    if t.shape != base.weight.shape or not torch.equal(
        t.to(base.weight.dtype), base.weight.detach().cpu()
    ):
        raise AdapterError(
            file,
            key,
            "a base weight that differs from the model's own (resized embeddings?)",
            "no base weights, or the model's own",
            "serve the model the adapter was trained on, or save it with "
            "save_embedding_layers=False",
        )


def _module(file, config, path: str, ab: dict, served: dict[str, nn.Module]) -> ModuleLoRA:
    base = served.get(path)
    if base is None:
        raise _not_served(file, path)
    if set(ab) != {"A", "B"}:
        raise AdapterError(file, path, f"only lora_{next(iter(ab))}", "both lora_A and lora_B")
    a, b = ab["A"], ab["B"]
    for name, t in (("lora_A", a), ("lora_B", b)):  # int8 / NaN refused, never cast
        check_tensor(file, f"{path}.{name}.weight", t)
    out_features, in_features = base.weight.shape
    want_a, want_b = (a.shape[0], in_features), (out_features, a.shape[0])
    if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != want_a or tuple(b.shape) != want_b:
        raise AdapterError(
            file,
            path,
            f"lora_A {list(a.shape)}, lora_B {list(b.shape)}",
            f"lora_A [r, {in_features}], lora_B [{out_features}, r]",
            "load the adapter for the model it was trained on",
        )
    scale = lora_scale(file, config, path, a.shape[0], f"{path}.lora_A.weight")
    return ModuleLoRA(a.float(), b.float() * scale)


def _not_served(file: str, path: str) -> AdapterError:
    return AdapterError(
        file,
        path,
        "LoRA on a module moelora does not serve (not an nn.Linear or router attach() "
        "wrapped: a norm, an embedding, a module the model lacks)",
        "LoRA on the routed experts, the routers or the model's nn.Linear modules",
        "re-train without this module, or attach with lora_target_modules naming it",
    )


class ModuleHooks:
    """The forward hooks of the served Linear modules and the routers' served forwards;
    remove() gives the model back."""

    def __init__(self, modules: dict[str, nn.Module], banks: ModuleBanks) -> None:
        self._undo = []
        for path, module in modules.items():
            a, bt = banks.a[path], banks.bt[path]
            if _linear(module):
                self._undo.append(module.register_forward_hook(_Delta(path, a, bt)).remove)
            else:  # a router: its logits are computed inside its forward
                self._undo.append(serve_router(module, path, a, bt))

    def remove(self) -> None:
        for undo in self._undo:
            undo()
        self._undo = []


class _Delta:
    """Forward hook of one Linear: output [..., M] + the per-token LoRA delta of its bank
    (a [L, R, N], bt [L, R, M]) for the current call's rows, when one of them has LoRA here."""

    def __init__(self, path: str, a: torch.Tensor, bt: torch.Tensor) -> None:
        self.path, self.a, self.bt = path, a, bt

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        rows = current()
        if rows is None or self.path not in rows.lora_modules:
            return None
        x = args[0]
        flat = x.reshape(-1, x.shape[-1])
        slots = rows.slots_for(flat.shape[0], "Linear input")
        delta = dense_lora_delta(flat.to(self.a.dtype), slots, self.a, self.bt)
        return output + delta.view(output.shape).to(output.dtype)
