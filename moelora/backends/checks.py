"""The one check: a backend's `Capabilities` against a `Deployment` -> typed reasons.

Each check below reads one group of fields and returns the reasons it fails (empty = passes).
They only compare values, so they never raise. `check_table` keeps the per-check split for
`moelora plan`; `check` is the flat list the oracle decides on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..deployment import Deployment, dtype_name
from .capabilities import Capabilities, Gating, Reason, Validation

Check = Callable[[Capabilities, Deployment], list[Reason]]


def _one_of(values: Iterable[object]) -> str:
    names = sorted(getattr(v, "value", None) or dtype_name(v) for v in values)
    return "one of " + ", ".join(names) if names else "nothing (none supported)"


def _cc(capability: tuple[int, int] | None) -> str | None:
    return None if capability is None else f"{capability[0]}.{capability[1]}"


def check_device(cap: Capabilities, dep: Deployment) -> list[Reason]:
    kind = dep.device.kind
    if kind not in cap.devices:
        return [Reason("device.kind", kind, "one of " + ", ".join(sorted(cap.devices)))]
    if kind == "cpu" and cap.cpu_needs_interpreter and not dep.device.interpreted:
        return [Reason("device.interpreted", False, "TRITON_INTERPRET=1 to run on cpu")]
    return []


def check_compute_capability(cap: Capabilities, dep: Deployment) -> list[Reason]:
    if dep.device.kind != "cuda":
        return []
    low, high = cap.min_compute_capability, cap.max_compute_capability
    if low is None and high is None:
        return []
    have = dep.device.compute_capability
    needed = " and ".join(
        part for part in (low and f">= {_cc(low)}", high and f"<= {_cc(high)}") if part
    )
    if have is None or (low and have < low) or (high and have > high):
        return [Reason("device.compute_capability", _cc(have), needed)]
    return []


def check_packages(cap: Capabilities, dep: Deployment) -> list[Reason]:
    missing = sorted(cap.packages - dep.device.packages)
    return [Reason("device.packages", f"missing {p}", f"{p} installed") for p in missing]


def check_dtype(cap: Capabilities, dep: Deployment) -> list[Reason]:
    if dep.dtype in cap.dtypes:
        return []
    return [Reason("dtype", dtype_name(dep.dtype), _one_of(cap.dtypes))]


def check_activation(cap: Capabilities, dep: Deployment) -> list[Reason]:
    act = dep.shape.activation
    reasons = []
    if act not in cap.activations:
        reasons.append(Reason("activation", act.value, _one_of(cap.activations)))
    if Gating.of(act) not in cap.gating:
        reasons.append(Reason("gating", Gating.of(act).value, _one_of(cap.gating)))
    return reasons


def check_routing(cap: Capabilities, dep: Deployment) -> list[Reason]:
    method = dep.routing.method
    if method in cap.routing_methods:
        return []
    return [Reason("routing", method.value, _one_of(cap.routing_methods))]


def check_expert_bias(cap: Capabilities, dep: Deployment) -> list[Reason]:
    if dep.shape.has_bias and not cap.expert_bias:
        return [Reason("has_bias", True, "experts without biases")]
    return []


def check_quantization(cap: Capabilities, dep: Deployment) -> list[Reason]:
    method = dep.quantization.method
    if method not in cap.quantizations:
        return [Reason("quantization", method.value, _one_of(cap.quantizations))]
    low, have = cap.quantizations[method], dep.device.compute_capability
    if dep.device.kind == "cuda" and low is not None and (have is None or have < low):
        needed = f">= {_cc(low)} for {method.value} experts"
        return [Reason("device.compute_capability", _cc(have), needed)]
    return []


def check_parallel(cap: Capabilities, dep: Deployment) -> list[Reason]:
    mode = dep.parallel_mode
    if mode in cap.parallel_modes:
        return []
    return [Reason("parallel_mode", mode.value, _one_of(cap.parallel_modes))]


def check_shape(cap: Capabilities, dep: Deployment) -> list[Reason]:
    reasons = []
    i_p, h = dep.intermediate_per_partition, dep.shape.hidden_size
    if i_p % cap.intermediate_align:
        needed = f"a multiple of {cap.intermediate_align} (I_p = I / tp)"
        reasons.append(Reason("intermediate_per_partition", i_p, needed))
    if h % cap.hidden_align:
        reasons.append(Reason("hidden_size", h, f"a multiple of {cap.hidden_align}"))
    if cap.max_experts is not None and dep.shape.num_experts > cap.max_experts:
        needed = f"at most {cap.max_experts}"
        reasons.append(Reason("num_experts", dep.shape.num_experts, needed))
    if cap.max_groups is not None and dep.num_groups > cap.max_groups:
        needed = f"at most {cap.max_groups} (one group per local expert)"
        reasons.append(Reason("num_groups", dep.num_groups, needed))
    return reasons


def check_lora(cap: Capabilities, dep: Deployment) -> list[Reason]:
    if not dep.lora_on_experts:
        if cap.runs_without_lora:
            return []
        return [Reason("lora.on_experts", False, "LoRA on the experts (LoRA-only backend)")]
    if not cap.lora:
        return [Reason("lora.on_experts", True, "no LoRA on the experts (no LoRA support)")]
    reasons = []
    rank, slots = dep.lora.max_rank, dep.lora.num_slots
    if cap.max_rank is not None and rank > cap.max_rank:
        reasons.append(Reason("lora.max_rank", rank, f"at most {cap.max_rank}"))
    if cap.max_slots is not None and slots > cap.max_slots:
        reasons.append(Reason("lora.num_slots", slots, f"at most {cap.max_slots}"))
    reasons += _check_add_inputs(cap, dep)
    return reasons


def _check_add_inputs(cap: Capabilities, dep: Deployment) -> list[Reason]:
    sharding, mode = dep.lora_sharding, dep.lora.add_inputs
    allowed = cap.lora_add_inputs.get(sharding, frozenset())
    if mode in allowed:
        return []
    if allowed:  # the sharding runs, only not with this mode
        value = f"{mode.value} under {sharding.value} LoRA"
        return [Reason("lora.add_inputs", value, f"{_one_of(allowed)} under {sharding.value}")]
    # The sharding itself is what fails, whatever the mode (e.g. fully sharded on grouped_mm).
    supported = [s.value for s, modes in cap.lora_add_inputs.items() if modes]
    needed = f"one of {', '.join(supported)} LoRA" if supported else "nothing (none supported)"
    return [Reason("lora.sharding", sharding.value, needed)]


def check_cuda_graphs(cap: Capabilities, dep: Deployment) -> list[Reason]:
    if dep.cuda_graphs and not cap.cuda_graph_safe:
        return [Reason("cuda_graphs", True, "eager execution (--enforce-eager)")]
    return []


# Fixed order: the rows of `moelora plan`'s table.
CHECKS: tuple[tuple[str, Check], ...] = (
    ("device", check_device),
    ("compute_capability", check_compute_capability),
    ("packages", check_packages),
    ("dtype", check_dtype),
    ("activation", check_activation),
    ("routing", check_routing),
    ("expert_bias", check_expert_bias),
    ("quantization", check_quantization),
    ("parallel", check_parallel),
    ("shape", check_shape),
    ("lora", check_lora),
    ("cuda_graphs", check_cuda_graphs),
)


def check_table(cap: Capabilities, dep: Deployment) -> list[tuple[str, list[Reason]]]:
    """[(check name, its reasons)] for every check, in CHECKS order."""
    return [(name, fn(cap, dep)) for name, fn in CHECKS]


def check(cap: Capabilities, dep: Deployment) -> list[Reason]:
    """Every reason `cap` cannot run `dep`; empty means supported. Never raises."""
    return [reason for _, reasons in check_table(cap, dep) for reason in reasons]


@dataclass(frozen=True)
class ValidationStatus:
    """Which of a record's validation runs speak for a deployment's device and dtype.

    level: "validated" (this GPU, or a cpu, in this dtype), "same_architecture" (another GPU
    of the same compute capability, in this dtype), "other_dtype" (this GPU or a cpu, other
    dtypes only) or "not_validated" (nothing matches). runs: the matching runs, best first.
    """

    level: str
    runs: tuple[Validation, ...]

    @property
    def validated(self) -> bool:
        return self.level == "validated"


def validation_status(cap: Capabilities, dep: Deployment) -> ValidationStatus:
    """How far `cap.validated_on` covers `dep` (a report, never a reason: it refuses nothing).
    Only runs that covered the deployment's experts format count."""
    device, method = dep.device, dep.quantization.method
    kind = [v for v in cap.validated_on if v.kind == device.kind and method in v.quantizations]
    if device.kind == "cuda":
        same = [v for v in kind if v.device.lower() in device.name.lower()]
        arch = [v for v in kind if v.compute_capability == device.compute_capability]
    else:  # every cpu counts as the same machine: the interpreter and torch run the same code
        same, arch = kind, kind
    in_dtype = [v for v in same if dep.dtype in v.dtypes]
    if in_dtype:
        return ValidationStatus("validated", tuple(in_dtype))
    arch_in_dtype = [v for v in arch if dep.dtype in v.dtypes]
    if arch_in_dtype:
        return ValidationStatus("same_architecture", tuple(arch_in_dtype))
    if same:
        return ValidationStatus("other_dtype", tuple(same))
    return ValidationStatus("not_validated", ())
