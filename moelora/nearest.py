"""The nearest deployment a backend would run: one remedy per failing reason, applied
together and re-checked against the backend's record, so that a refusal can name a fix
that is known to work (or say that none of the settings moelora can change is one).

A remedy changes one setting a user controls (a flag of `moelora plan`, or the
TRITON_INTERPRET / pip environment); the model's own facts (activation, routing, biases,
hidden size) have none. Never raises: a remedy whose deployment is inconsistent (a tp that
no longer divides I, say) is simply not offered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from .backends.base import Backend, Capabilities, Reason, check
from .config import LoRAConfig, ParallelConfig
from .deployment import Deployment, LoRASharding, ParallelMode, dtype_name
from .device import TARGETS, target
from .errors import MoeloraError

Remedy = tuple[str, Callable[[Deployment], Deployment]]  # (the change, as flags; apply it)

# dtype order of preference for a fix: the serving dtype first.
_DTYPE_ORDER = (torch.bfloat16, torch.float16, torch.float32)


def _replace(dep: Deployment, **changes) -> Deployment:
    return dataclasses.replace(dep, **changes)


def _device_remedy(cap: Capabilities, dep: Deployment) -> Remedy | None:
    """A named target of a kind (and compute capability) the record allows; targets it was
    validated on first."""
    validated = {v.device for v in cap.validated_on}
    rows = sorted(TARGETS.items(), key=lambda row: row[1][1] not in validated)
    low, high = cap.min_compute_capability, cap.max_compute_capability
    for name, (kind, _, cc) in rows:
        if kind not in cap.devices or (kind, cc) == (
            dep.device.kind,
            dep.device.compute_capability,
        ):
            continue
        if kind == "cuda" and ((low and cc < low) or (high and cc > high)):
            continue
        graphs = kind == "cuda" and cap.cuda_graph_safe  # what --device NAME defaults to
        flags = f"--device {name}" + (" --enforce-eager" if kind == "cuda" and not graphs else "")
        return flags, lambda d, n=name, g=graphs: _replace(d, device=target(n), cuda_graphs=g)
    return None


def _parallel_remedy(cap: Capabilities, dep: Deployment) -> Remedy | None:
    """Drop expert parallel, or tensor parallel, or both: the first the record allows."""
    tp, ep, fs = dep.parallel.tp, dep.parallel.ep, dep.parallel.fully_sharded_loras
    options = []
    if tp > 1:
        options.append(
            (ParallelMode.TP, f"-tp {tp} without expert parallel", ParallelConfig(tp, 1, fs))
        )
    if ep > 1:
        options.append((ParallelMode.EP, f"-tp 1 -ep {ep}", ParallelConfig(1, ep)))
    options.append((ParallelMode.SINGLE, "-tp 1 without expert parallel", ParallelConfig(1, 1)))
    for mode, flags, parallel in options:
        if mode in cap.parallel_modes:
            return flags, lambda d, p=parallel: _replace(d, parallel=p)
    return None


def _tp_remedy(cap: Capabilities, dep: Deployment) -> Remedy | None:
    """The largest tp below this one whose I_p meets the alignment (tp 1 last)."""
    size = dep.shape.intermediate_size
    for tp in range(dep.parallel.tp - 1, 0, -1):
        if size % tp == 0 and (size // tp) % cap.intermediate_align == 0:
            parallel = dataclasses.replace(dep.parallel, tp=tp)
            return f"-tp {tp}", lambda d, p=parallel: _replace(d, parallel=p)
    return None


def _ep_remedy(cap: Capabilities, dep: Deployment) -> Remedy | None:
    """The smallest ep above this one that leaves at most max_groups local experts."""
    experts, limit = dep.shape.num_experts, cap.max_groups or dep.shape.num_experts
    for ep in range(dep.parallel.ep + 1, experts + 1):
        if experts % ep == 0 and experts // ep <= limit:
            parallel = dataclasses.replace(dep.parallel, ep=ep)
            return f"-ep {ep}", lambda d, p=parallel: _replace(d, parallel=p)
    return None


def _lora(dep: Deployment, **changes) -> Deployment:
    return _replace(dep, lora=dataclasses.replace(dep.lora, **changes))


def _sharding_remedy(cap: Capabilities, dep: Deployment) -> Remedy | None:
    if cap.lora_add_inputs.get(LoRASharding.TP):
        parallel = dataclasses.replace(dep.parallel, fully_sharded_loras=False)
        return "without --fully-sharded-loras", lambda d: _replace(d, parallel=parallel)
    if cap.lora_add_inputs.get(LoRASharding.UNSHARDED):
        return "-tp 1", lambda d: _replace(d, parallel=ParallelConfig(1, dep.parallel.ep))
    return None


def _add_inputs_remedy(cap: Capabilities, dep: Deployment) -> Remedy | None:
    allowed = sorted(m.value for m in cap.lora_add_inputs.get(dep.lora_sharding, ()))
    if not allowed:
        return None
    mode = type(dep.lora.add_inputs)(allowed[0])
    return f"--lora-add-inputs {mode.value}", lambda d: _lora(d, add_inputs=mode)


def _remedy(cap: Capabilities, dep: Deployment, reason: Reason) -> Remedy | None:
    """The one change that answers `reason`, or None when no setting can."""
    field = reason.field
    if field == "device.kind" or field == "device.compute_capability":
        return _device_remedy(cap, dep)
    if field == "device.interpreted":
        device = dataclasses.replace(dep.device, interpreted=True)
        return "export TRITON_INTERPRET=1", lambda d: _replace(d, device=device)
    if field == "device.packages":
        package = str(reason.value).removeprefix("missing ")
        device = dataclasses.replace(dep.device, packages=dep.device.packages | {package})
        return f"pip install {package}", lambda d: _replace(d, device=device)
    if field == "dtype":
        for dtype in _DTYPE_ORDER:
            if dtype in cap.dtypes:
                shape = dataclasses.replace(dep.shape, dtype=dtype)
                return f"--dtype {dtype_name(dtype)}", lambda d, s=shape: _replace(d, shape=s)
        return None
    if field == "parallel_mode":
        return _parallel_remedy(cap, dep)
    if field == "intermediate_per_partition":
        return _tp_remedy(cap, dep)
    if field == "num_groups":
        return _ep_remedy(cap, dep)
    if field == "lora.on_experts":
        if reason.value:  # a backend without LoRA support
            return "without --enable-lora", lambda d: _replace(d, lora=LoRAConfig())
        return "--enable-lora", lambda d: _lora(d, enabled=True, targets=LoRAConfig().targets)
    if field == "lora.max_rank" and cap.max_rank:
        return f"--max-lora-rank {cap.max_rank}", lambda d: _lora(d, max_rank=cap.max_rank)
    if field == "lora.num_slots" and cap.max_slots:
        return f"--max-loras {cap.max_slots}", lambda d: _lora(d, num_slots=cap.max_slots)
    if field == "lora.sharding":
        return _sharding_remedy(cap, dep)
    if field == "lora.add_inputs":
        return _add_inputs_remedy(cap, dep)
    if field == "cuda_graphs":
        return "--enforce-eager", lambda d: _replace(d, cuda_graphs=False)
    return None  # activation, gating, routing, has_bias, hidden_size, num_experts: the model's


def nearest_for(cap: Capabilities, dep: Deployment) -> tuple[str, ...] | None:
    """The changes after which `cap` accepts `dep` (() if it already does), re-checked; None
    if some reason has no remedy or the changed deployment still fails or is inconsistent."""
    remedies = []
    for reason in check(cap, dep):
        remedy = _remedy(cap, dep, reason)
        if remedy is None:
            return None
        if remedy[0] not in (flags for flags, _ in remedies):
            remedies.append(remedy)
    changed = dep
    try:  # each apply builds a new Deployment, which runs its consistency checks
        for _, apply in remedies:
            changed = apply(changed)
    except (MoeloraError, ValueError, TypeError):
        return None
    if check(cap, changed):
        return None
    return tuple(flags for flags, _ in remedies)


def nearest(
    dep: Deployment, registry: Mapping[str, Backend], names: list[str] | None = None, limit: int = 3
) -> list[tuple[str, tuple[str, ...]]]:
    """(backend, changes) for the backends in `names` (default: all) that some change makes
    accept `dep`: fewest changes first, then the ranking; at most `limit`."""
    found = []
    for rank, name in enumerate(names if names is not None else list(registry)):
        changes = nearest_for(registry[name].capabilities, dep)
        if changes:  # () = accepts already: not a fix
            found.append((len(changes), rank, name, changes))
    return [(name, changes) for _, _, name, changes in sorted(found)[:limit]]
