"""A model directory made servable: the oracle's verdict first (before any weight is read),
then the weights, the tokenizer, moelora attached and the startup adapters loaded.

Used by `moelora serve`, `moelora run-batch` and the load generator.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import LoRAConfig, from_hf, parse_dtype
from ..deployment import Deployment
from ..device import probe_device
from ..errors import ConfigError
from ..oracle import select

log = logging.getLogger("moelora.serve")


@dataclass(frozen=True)
class ServeSettings:
    """The vLLM-named flags that shape the served model (docs/serve.md)."""

    model: Path
    lora_modules: dict[str, Path] = field(default_factory=dict)
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    dtype: str = "auto"
    moe_backend: str = "auto"
    enforce_eager: bool = False
    max_num_seqs: int = 64
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None  # None: --max-num-seqs rows of KV cache


def parse_lora_modules(items: list[str]) -> dict[str, Path]:
    """--lora-modules name=DIR ... -> {name: DIR}."""
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError("--lora-modules", item, "NAME=DIR", "e.g. --lora-modules math=./math")
        out[name] = Path(path)
    return out


def device_and_dtype(settings: ServeSettings) -> tuple[str, torch.dtype]:
    """cuda when present; dtype auto = bf16 on a GPU (serving), fp32 on a CPU."""
    cuda = torch.cuda.is_available()
    if settings.dtype != "auto":
        return ("cuda" if cuda else "cpu"), parse_dtype(settings.dtype, "--dtype")
    return ("cuda" if cuda else "cpu"), (torch.bfloat16 if cuda else torch.float32)


def preflight(settings: ServeSettings) -> str:
    """The oracle's selection line for this model and flags, from config.json alone
    (raises UnsupportedDeploymentError / ConfigError before any weight is read)."""
    config = settings.model / "config.json"
    if not config.is_file():
        raise ConfigError("MODEL_DIR", str(settings.model), "a model directory with config.json",
                          "save_pretrained the model there")  # fmt: skip
    device, dtype = device_and_dtype(settings)
    model_config = from_hf(config)
    deployment = Deployment.for_model(
        model_config,
        dtype=dtype,
        device=probe_device(device),
        lora=LoRAConfig(
            enabled=True,
            max_rank=settings.max_lora_rank,
            num_slots=settings.max_loras,
            targets=("experts",),
        ),
        cuda_graphs=device == "cuda" and not settings.enforce_eager,
        backend=settings.moe_backend,
    )
    return select(deployment).log_line()


def load(settings: ServeSettings, model=None):
    """(handle, tokenizer): the weights on the device, attached, startup adapters loaded.
    model: a transformers model already built on the device (the load generator's random
    weights) instead of the directory's weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..hf import attach

    root = settings.model
    if not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError("MODEL_DIR", str(root), "a model directory with a tokenizer "
                          "(tokenizer.json)", "save the tokenizer beside the model")  # fmt: skip
    for name, path in settings.lora_modules.items():  # refusals before the weights load
        if not (path / "adapter_config.json").is_file():
            raise ConfigError("--lora-modules", f"{name}={path}",
                              "a PEFT adapter directory (adapter_config.json)")  # fmt: skip
    device, dtype = device_and_dtype(settings)
    tokenizer = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(root), dtype=dtype, local_files_only=True)
    handle = attach(
        model.to(device).eval(),
        num_slots=settings.max_loras,
        max_rank=settings.max_lora_rank,
        moe_backend=settings.moe_backend,
        enforce_eager=settings.enforce_eager,
        max_cpu_loras=settings.max_cpu_loras,
    )
    for name, path in settings.lora_modules.items():
        handle.load_adapter(path, name=name)
    return handle, tokenizer
