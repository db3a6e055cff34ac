"""Where each backend has been validated, as `moelora plan` reports it: supported (the
capability record) is not validated (the runs in `Capabilities.validated_on`)."""

from __future__ import annotations

from typing import Any

from ...backends.capabilities import Capabilities
from ...backends.checks import ValidationStatus, validation_status
from ...deployment import Deployment, dtype_name


def validation(name: str, cap: Capabilities, deployment: Deployment) -> dict[str, Any]:
    """The plan's `validation` of one backend: level, the matching runs, every place it
    has been validated, and the warning when this target is not covered."""
    status = validation_status(cap, deployment)
    runs = [
        {
            "device": v.device,
            "compute_capability": _cc(v.compute_capability),
            "dtypes": sorted(dtype_name(d) for d in v.dtypes),
            "date": v.date,
            "result": v.result,
            "source": v.source,
        }
        for v in status.runs
    ]
    return {
        "level": status.level,
        "runs": runs,
        "validated_on": validated_places(cap),
        "warning": _warning(name, cap, deployment, status),
    }


def _warning(name: str, cap: Capabilities, dep: Deployment, status: ValidationStatus) -> str | None:
    """Supported is not validated: say where it has run, and how to validate it here."""
    if status.validated:
        return None
    where = dep.device.name
    if dep.device.compute_capability:
        where += f" (compute capability {_cc(dep.device.compute_capability)})"
    dtype = dtype_name(dep.dtype)
    elsewhere = validated_places(cap)
    short = {"bfloat16": "", "float16": " --dtype fp16", "float32": " --dtype fp32"}[dtype]
    how = (
        f"run `moelora validate --backends {name}{short}` on that machine before serving"
        if name != "reference"
        else "run `moelora validate` on that machine (it checks triton against the reference)"
    )
    head = {
        "same_architecture": f"{name} has been validated in {dtype} on a GPU of the same "
        f"compute capability, not on {where} itself",
        "other_dtype": f"{name} has been validated on {where} but not in {dtype}",
        "not_validated": f"{name} has not been validated on {where} in {dtype}",
    }[status.level]
    return (
        f"{head} (its capability record allows it: supported is not validated). "
        f"It has been validated on: {elsewhere}. Fix: {how}"
    )


def validated_places(cap: Capabilities) -> str:
    """'NVIDIA H200 (9.0) in bfloat16, float16; cpu in float32': the record's runs by device."""
    places: dict[str, set[str]] = {}
    for v in cap.validated_on:
        cc = f" ({_cc(v.compute_capability)})" if v.compute_capability else ""
        places.setdefault(v.device + cc, set()).update(dtype_name(d) for d in v.dtypes)
    order = ("bfloat16", "float16", "float32")
    return (
        "; ".join(
            f"{place} in {', '.join(sorted(dtypes, key=order.index))}"
            for place, dtypes in places.items()
        )
        or "nowhere yet"
    )


def _cc(capability: tuple[int, int] | None) -> str | None:
    return None if capability is None else f"{capability[0]}.{capability[1]}"
