"""A model directory made servable: the oracle's verdict first (before any weight is read),
then the weights (the directory's, or random ones with --load-format dummy), the
tokenizer, moelora attached and the startup adapters loaded.

Used by `moelora serve`, `moelora run-batch` and the load generator.
"""

from __future__ import annotations

import enum
import json
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


class LoadFormat(str, enum.Enum):
    """--load-format, vLLM's meanings: auto and safetensors read the directory's weights
    (safetensors: only .safetensors files); dummy builds random weights of the config's
    shapes on the device (config and tokenizer still from the directory)."""

    AUTO = "auto"
    SAFETENSORS = "safetensors"
    DUMMY = "dummy"


class DecodeRunner(str, enum.Enum):
    """--decode-runner: where decode steps and prefills run. auto: moelora's decode runner on
    a CUDA GPU when it knows the model's family (the engine's runner=None); on: the runner
    wherever the model runs, a model it does not know refused with why (runner=True); off:
    transformers' forward (runner=False). On the runner the KV cache is paged (blocks of
    --block-size positions); on transformers' forward it is one slab of --max-model-len per
    row."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"

    @property
    def engine_value(self) -> bool | None:
        """The Engine's `runner` argument."""
        return {DecodeRunner.AUTO: None, DecodeRunner.ON: True, DecodeRunner.OFF: False}[self]


# vLLM's dummy weights: every floating tensor uniform in [-1e-3, 1e-3] (vLLM found this
# range gives no NaN for most models), each from a generator seeded with 1234 (vLLM's), so
# two servers of one config hold the same weights.
DUMMY_RANGE = (-1e-3, 1e-3)
DUMMY_SEED = 1234


@dataclass(frozen=True)
class LoraModule:
    """One --lora-modules entry: NAME=DIR, or vLLM's JSON form with base_model_name."""

    path: Path
    base_model_name: str | None = None


@dataclass(frozen=True)
class ServeSettings:
    """The vLLM-named flags that shape the served model (docs/serve.md)."""

    model: Path
    lora_modules: dict[str, LoraModule] = field(default_factory=dict)
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    dtype: str = "auto"
    moe_backend: str = "auto"
    enforce_eager: bool = False
    max_num_seqs: int = 64
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None  # None: --max-num-seqs rows of KV cache
    chat_template: str | None = None  # --chat-template: a file, or the template itself
    load_format: LoadFormat = LoadFormat.AUTO
    decode_runner: DecodeRunner = DecodeRunner.AUTO
    # the paged KV cache (the decode runner's; vLLM's CacheConfig names)
    block_size: int = 16  # positions per block
    num_gpu_blocks_override: int | None = None  # None: --max-num-seqs rows' worth, or sized
    # by --gpu-memory-utilization
    enable_prefix_caching: bool = True


def parse_lora_modules(items: list[str]) -> dict[str, LoraModule]:
    """--lora-modules entries -> {name: LoraModule}: NAME=DIR, or vLLM's JSON form
    '{"name": ..., "path": ..., "base_model_name": ...}'. A name given twice is refused."""
    out: dict[str, LoraModule] = {}
    for item in items:
        name, module = _lora_module(item)
        if name in out:
            raise ConfigError("--lora-modules", f"{name!r} twice ({out[name].path} and "
                              f"{module.path})", "each adapter name once",
                              "give each adapter its own name")  # fmt: skip
        out[name] = module
    return out


def _lora_module(item: str) -> tuple[str, LoraModule]:
    expected = 'NAME=DIR or \'{"name": NAME, "path": DIR, "base_model_name": BASE}\''
    if item.lstrip().startswith("{"):
        try:
            entry = json.loads(item)
        except json.JSONDecodeError as err:
            raise ConfigError("--lora-modules", item, expected, f"fix the JSON ({err})") from None
        known = {"name", "path", "base_model_name"}
        name, path, base = entry.get("name"), entry.get("path"), entry.get("base_model_name")
        if set(entry) - known or not isinstance(name, str) or not name or not isinstance(
                path, str) or not path or not isinstance(base, (str, type(None))):  # fmt: skip
            raise ConfigError("--lora-modules", item, expected,
                              f"JSON with the keys {sorted(known)}; name and path strings")  # fmt: skip
        return name, LoraModule(Path(path), base)
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
        raise ConfigError("--lora-modules", item, expected, "e.g. --lora-modules math=./math")
    return name, LoraModule(Path(path))


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
    _check_model_len(settings, config)
    _check_blocks(settings, config)
    device, dtype = device_and_dtype(settings)
    model_config = from_hf(config)
    if settings.load_format is LoadFormat.DUMMY and model_config.quantization.method.is_fp8:
        raise ConfigError("--load-format", "dummy", "a model whose config.json has no FP8 "
                          "quantization_config (random FP8 experts and scales are not built)",
                          "serve the FP8 checkpoint's own weights (--load-format auto)")  # fmt: skip
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


def _check_model_len(settings: ServeSettings, config: Path) -> None:
    """--max-model-len past the model's positions is refused (as vLLM refuses it)."""
    if settings.max_model_len is None:
        return
    positions = _positions(config)
    if positions is not None and settings.max_model_len > positions:
        raise ConfigError("--max-model-len", settings.max_model_len,
                          f"at most the model's max_position_embeddings ({positions})",
                          f"pass --max-model-len {positions} or less, or leave it out")  # fmt: skip


def _check_blocks(settings: ServeSettings, config: Path) -> None:
    """--num-gpu-blocks-override: only where the KV cache is paged, and at least one
    --max-model-len request's blocks and the null block (the engine refuses fewer)."""
    from .kv_budget import min_blocks

    blocks = settings.num_gpu_blocks_override
    if blocks is None:
        return
    if settings.decode_runner is DecodeRunner.OFF:
        raise ConfigError("--num-gpu-blocks-override", blocks, "a paged KV cache to size, "
                          "which only the decode runner keeps (--decode-runner off: one slab "
                          "of --max-model-len per row, --max-num-seqs rows)",
                          "leave --num-gpu-blocks-override out, or pass --decode-runner auto "
                          "or on")  # fmt: skip
    max_len = settings.max_model_len or _positions(config)
    if max_len is None:
        return  # no length in config.json: the engine checks it once the model is built
    need = min_blocks(max_len, settings.block_size)
    if blocks < need:
        raise ConfigError("--num-gpu-blocks-override", blocks,
                          f">= {need}: one request of --max-model-len {max_len} fills "
                          f"{need - 1} blocks of --block-size {settings.block_size}, and "
                          "block 0 is the null block",
                          f"pass --num-gpu-blocks-override {need} or more, or a smaller "
                          "--max-model-len")  # fmt: skip


def _positions(config: Path) -> int | None:
    """config.json's max_position_embeddings (the text model's in a multimodal config)."""
    raw = json.loads(config.read_text())
    raw = raw.get("text_config", raw)  # multimodal configs (Llama 4) nest the text model's
    positions = raw.get("max_position_embeddings")
    return None if positions is None else int(positions)


def chat_template(value: str) -> str:
    """--chat-template: a file's contents when `value` names a file, else the template."""
    path = Path(value)
    try:
        if path.is_file():
            return _parsed(path.read_text())
    except OSError as err:
        raise ConfigError("--chat-template", value, "a readable file or a Jinja template",
                          f"fix the path ({err.strerror})") from None  # fmt: skip
    if "{" not in value:  # neither a file nor a template: most likely a mistyped path
        raise ConfigError("--chat-template", value, "a file that exists, or a Jinja template "
                          "({% ... %} / {{ ... }})", "check the path")  # fmt: skip
    return _parsed(value)


def _parsed(template: str) -> str:
    """The template, once Jinja parses it (a syntax error is refused at start, not at the
    first chat request)."""
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as err:
        raise ConfigError("--chat-template", template[:80], "a Jinja template",
                          f"fix line {err.lineno}: {err.message}") from None  # fmt: skip
    return template


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
    for name, module in settings.lora_modules.items():  # refusals before the weights load
        if not (module.path / "adapter_config.json").is_file():
            raise ConfigError("--lora-modules", f"{name}={module.path}",
                              "a PEFT adapter directory (adapter_config.json)")  # fmt: skip
    device, dtype = device_and_dtype(settings)
    tokenizer = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    if settings.chat_template is not None:
        tokenizer.chat_template = chat_template(settings.chat_template)
    if model is None and settings.load_format is LoadFormat.DUMMY:
        model = dummy_model(root, device, dtype)
    elif model is None:
        only_safetensors = {"use_safetensors": True} if (
            settings.load_format is LoadFormat.SAFETENSORS) else {}  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(str(root), dtype=dtype, local_files_only=True,
                                                     **only_safetensors)  # fmt: skip
    handle = attach(
        model.to(device).eval(),
        num_slots=settings.max_loras,
        max_rank=settings.max_lora_rank,
        moe_backend=settings.moe_backend,
        enforce_eager=settings.enforce_eager,
        max_cpu_loras=settings.max_cpu_loras,
    )
    for name, module in settings.lora_modules.items():
        handle.load_adapter(module.path, name=name)
    return handle, tokenizer


def dummy_model(root: Path, device: str, dtype: torch.dtype):
    """--load-format dummy: the model of root's config.json built on `device` (no weight
    file read), every floating tensor filled as vLLM's dummy loader fills it; the
    directory's generation_config.json (end tokens, ...) when it has one."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if (root / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(root))
    low, high = DUMMY_RANGE
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                generator = torch.Generator(tensor.device).manual_seed(DUMMY_SEED)
                tensor.uniform_(low, high, generator=generator)
    return model
