"""The only place moelora probes hardware and installed packages.

`probe()` describes the local machine; `target(name)` describes a named machine (h200, b200,
sm103, cpu, ...) so that a deployment can be checked for a GPU from a machine without one.
Both return a `DeviceFacts`; nothing else in moelora asks torch or importlib what exists.
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


def probe() -> DeviceFacts:
    """Facts of this machine's first visible device (cuda if available, else cpu)."""
    packages = installed_packages()
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        return DeviceFacts(
            kind="cuda",
            name=torch.cuda.get_device_name(index),
            compute_capability=tuple(torch.cuda.get_device_capability(index)),
            packages=packages,
        )
    return DeviceFacts(kind="cpu", name="cpu", packages=packages, interpreted=triton_interpreted())


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
