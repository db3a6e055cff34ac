"""The only place moelora probes hardware and installed packages.

`probe()` describes the local machine; `target(name)` describes a named machine (h200, b200,
sm103, cpu, ...) so that a deployment can be checked for a GPU from a machine without one.
Both return a `DeviceFacts`; nothing else in moelora asks torch or importlib what exists.
"""

from __future__ import annotations

import importlib.util
import os

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


def triton_interpreted() -> bool:
    """True when Triton kernels run through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def probe() -> DeviceFacts:
    """Facts of this machine's first visible device (cuda if available, else cpu)."""
    return probe_device("cuda" if torch.cuda.is_available() else "cpu")


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
