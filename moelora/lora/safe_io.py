"""Reading an adapter directory without running code from it.

safetensors first; a legacy `adapter_model.bin` only through `torch.load(weights_only=True)`;
no path is followed outside the adapter directory (symlinks that escape it are refused).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..errors import AdapterError

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
LEGACY_NAME = "adapter_model.bin"


def inside(root: Path, name: str) -> Path:
    """root / name, resolved; refused if it (or a symlink on the way) leaves root."""
    root_real = root.resolve()
    path = (root / name).resolve()
    if path != root_real and root_real not in path.parents:
        raise AdapterError(
            str(root / name),
            "path",
            f"a link to '{path}' outside the adapter directory",
            f"a file inside '{root_real}'",
            "copy the file into the adapter directory instead of linking to it",
        )
    return path


def read_config(root: Path) -> dict[str, Any]:
    """The parsed adapter_config.json of the directory `root`."""
    if not root.is_dir():
        raise AdapterError(str(root), "path", "no directory", "a PEFT adapter directory")
    path = inside(root, CONFIG_NAME)
    if not path.is_file():
        raise AdapterError(
            str(path),
            CONFIG_NAME,
            "no such file",
            "the PEFT adapter_config.json",
            "save the adapter with PeftModel.save_pretrained",
        )
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AdapterError(
            str(path), CONFIG_NAME, f"invalid JSON ({err})", "a JSON object"
        ) from None
    if not isinstance(config, dict):
        raise AdapterError(str(path), CONFIG_NAME, type(config).__name__, "a JSON object")
    return config


def read_tensors(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """(file, name -> tensor on the CPU) from adapter_model.safetensors, else the legacy .bin."""
    safe = inside(root, SAFETENSORS_NAME)
    if safe.is_file():
        return safe, _read_safetensors(safe)
    legacy = inside(root, LEGACY_NAME)
    if legacy.is_file():
        return legacy, _read_legacy(legacy)
    raise AdapterError(
        str(root / SAFETENSORS_NAME),
        SAFETENSORS_NAME,
        "no such file (nor a legacy adapter_model.bin)",
        "the adapter weights",
        "save the adapter with PeftModel.save_pretrained",
    )


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as err:  # SafetensorError, OSError, ValueError: all mean a bad file
        raise AdapterError(
            str(path),
            "<header>",
            f"an unreadable file ({type(err).__name__}: {err})",
            "a complete safetensors file",
            "the file is truncated or corrupt: copy or save it again",
        ) from None


def _read_legacy(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # weights_only refuses pickled code: never retry without it
        raise AdapterError(
            str(path),
            "<pickle>",
            f"a file torch.load(weights_only=True) refuses ({type(err).__name__})",
            "a plain tensor dict",
            "convert the adapter to adapter_model.safetensors",
        ) from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise AdapterError(str(path), "<pickle>", type(state).__name__, "a dict of name -> tensor")
    return state
