"""The only place moelora probes hardware and installed packages.

`probe()` describes the local machine; `target(name)` describes a named machine (h200, b200,
sm103, cpu, ...) so that a deployment can be checked for a GPU from a machine without one.
Both return a `DeviceFacts`; nothing else in moelora asks torch or importlib what exists.
`fact_sources` says where each fact came from (probed here, or the target table's
assumption), and `differences` where a named target and this machine disagree, and why.
`gpu_limits(device)` gives the `triton` backend what it sizes and launches kernels by;
`triton_interpreted()` is the one reading of TRITON_INTERPRET.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

from .config import DeviceFacts
from .errors import ConfigError

# Packages a backend may require. Probed with find_spec (nothing is imported).
KNOWN_PACKAGES = ("torch", "triton", "numpy", "transformers", "peft", "safetensors")

# A named target is assumed to have moelora's install requirements (pyproject.toml);
# triton is declared there for Linux, which every GPU target runs.
TARGET_PACKAGES = frozenset({"torch", "triton", "numpy"})

# Named targets: (kind, name, compute capability). Capabilities from NVIDIA's CUDA GPU table.
TARGETS: dict[str, tuple[str, str, tuple[int, int] | None]] = {
    "a100": ("cuda", "NVIDIA A100", (8, 0)),
    "sm80": ("cuda", "sm80", (8, 0)),
    "h100": ("cuda", "NVIDIA H100", (9, 0)),
    "h200": ("cuda", "NVIDIA H200", (9, 0)),
    "sm90": ("cuda", "sm90", (9, 0)),
    "b200": ("cuda", "NVIDIA B200", (10, 0)),
    "sm100": ("cuda", "sm100", (10, 0)),
    "b300": ("cuda", "NVIDIA B300", (10, 3)),
    "sm103": ("cuda", "sm103", (10, 3)),
    "cpu": ("cpu", "cpu", None),
}

LOCAL = "local"


def installed_packages() -> frozenset[str]:
    """The KNOWN_PACKAGES importable here."""
    return frozenset(p for p in KNOWN_PACKAGES if importlib.util.find_spec(p) is not None)


# How Triton reads a boolean variable (triton.knobs' getenv_bool): these values, any case.
_TRITON_TRUE = ("1", "true", "on", "yes", "y")


def triton_interpreted() -> bool:
    """True when Triton runs kernels through its CPU interpreter: TRITON_INTERPRET read as
    Triton reads it (1, true, on, yes or y, any case), so moelora and Triton agree."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRITON_TRUE


@dataclass(frozen=True)
class GpuLimits:
    """What the `triton` backend sizes and launches its kernels by, for one GPU."""

    shared_memory: int  # bytes of shared memory one block may use
    major: int  # compute capability major; 0 on ROCm (no NVIDIA sm_90 features)

    @property
    def tma(self) -> bool:
        """TMA tile copies (sm_90+)."""
        return self.major >= 9

    @property
    def pdl(self) -> bool:
        """Programmatic dependent launch, griddepcontrol (sm_90+)."""
        return self.major >= 9


def gpu_limits(device: torch.device) -> GpuLimits | None:
    """The limits of CUDA device `device` (probed once per device), None off CUDA."""
    if device.type != "cuda":
        return None
    return _gpu_limits(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _gpu_limits(index: int) -> GpuLimits:
    import triton  # only on a CUDA device, where the triton backend runs

    props = triton.runtime.driver.active.utils.get_device_properties(index)
    major = 0 if torch.version.hip else torch.cuda.get_device_capability(index)[0]
    return GpuLimits(int(props["max_shared_mem"]), major)


def probe(kind: str | None = None) -> DeviceFacts:
    """Facts of this machine's first visible device (cuda if available, else cpu).
    kind="cpu": this machine's cpu even when it has a GPU (what `validate --device cpu` runs)."""
    return probe_device("cuda" if kind != "cpu" and torch.cuda.is_available() else "cpu")


def target(name: str) -> DeviceFacts:
    """Facts of a named target. A named cpu target is assumed to run Triton interpreted (as CI)."""
    key = name.lower()
    if key not in TARGETS:
        raise ConfigError(
            "device",
            name,
            f"'{LOCAL}' or a named target ({', '.join(TARGETS)})",
            "pick one of the listed targets",
        )
    kind, label, capability = TARGETS[key]
    return DeviceFacts(
        kind=kind,
        name=label,
        compute_capability=capability,
        packages=TARGET_PACKAGES,
        interpreted=kind == "cpu",
    )


def resolve_device(name: str | None = None) -> DeviceFacts:
    """'local' or None -> probe(); anything else -> target(name)."""
    return probe() if name in (None, LOCAL) else target(name)


def probe_device(device: torch.device | str) -> DeviceFacts:
    """Facts of one local torch device: a model held on the CPU of a machine with a GPU is
    served on the CPU, so its deployment must say cpu, not what probe() finds first."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return DeviceFacts(
            kind="cuda",
            name=torch.cuda.get_device_name(index),
            compute_capability=tuple(torch.cuda.get_device_capability(index)),
            packages=installed_packages(),
        )
    if device.type != "cpu":
        raise ConfigError("device", str(device), "a cuda or cpu device", "move the model there")
    return DeviceFacts(
        kind="cpu", name="cpu", packages=installed_packages(), interpreted=triton_interpreted()
    )


# Where a named target's facts come from (its row of TARGETS: NVIDIA's CUDA GPU table).
_TABLE = "the target table (moelora/device.py)"
_ASSUMED = {
    "packages": "assumed: moelora's install requirements (pyproject.toml)",
    "triton_interpreted": "assumed: TRITON_INTERPRET=1, as the tests and CI run on a cpu",
}


@dataclass(frozen=True)
class FactSource:
    """One device fact, its value as the checks read it, and where it came from."""

    fact: str
    value: str
    source: str


def fact_sources(name: str | None, facts: DeviceFacts) -> list[FactSource]:
    """Each fact of resolve_device(name) and where it came from: probed here or assumed."""
    cc = facts.compute_capability
    values = {
        "kind": facts.kind,
        "name": facts.name,
        "compute_capability": f"{cc[0]}.{cc[1]}" if cc else "-",
        "packages": ", ".join(sorted(facts.packages)) or "none",
        "triton_interpreted": "yes" if facts.interpreted else "no",
    }
    if name in (None, LOCAL):
        env = os.environ.get("TRITON_INTERPRET")
        sources = {
            "kind": "probed: torch.cuda.is_available()",
            "name": "probed: torch.cuda.get_device_name()" if cc else "probed: no GPU",
            "compute_capability": "probed: torch.cuda.get_device_capability()" if cc else "-",
            "packages": "probed: importable here",
            "triton_interpreted": f"probed: TRITON_INTERPRET={env}" if env is not None
            else "probed: TRITON_INTERPRET is not set",
        }  # fmt: skip
    else:
        sources = dict.fromkeys(("kind", "name", "compute_capability"), _TABLE) | _ASSUMED
        if facts.kind == "cuda":
            sources["triton_interpreted"] = "-"
    return [FactSource(fact, value, sources[fact]) for fact, value in values.items()]


def counterpart(facts: DeviceFacts) -> str | None:
    """The first named target describing the same kind of machine (kind and compute
    capability) as `facts`, or None."""
    for name, (kind, _, cc) in TARGETS.items():
        if (kind, cc) == (facts.kind, facts.compute_capability):
            return name
    return None


def differences(name: str, named: DeviceFacts, local: DeviceFacts) -> list[str]:
    """Where the named target `name` and this machine differ although they are the same kind
    of machine (the cpu target on a cpu, or a GPU target of this GPU's compute capability):
    what differs, what it changes, and the fix. The two never disagree silently."""
    if (named.kind, named.compute_capability) != (local.kind, local.compute_capability):
        return []
    notes = []
    if named.interpreted and not local.interpreted:
        notes.append(
            f"--device {name} assumes TRITON_INTERPRET=1 and this machine does not set it, so "
            f"on --device {LOCAL} triton is refused here (device.interpreted = False). Fix: "
            "export TRITON_INTERPRET=1 to run Triton's interpreter here (slow, exact)"
        )
    missing = sorted(named.packages - local.packages)
    if missing:
        notes.append(
            f"--device {name} assumes {', '.join(missing)} installed and this machine lacks "
            f"it, so on --device {LOCAL} the backends that need it are refused here. "
            f"Fix: pip install {' '.join(missing)}"
        )
    return notes
