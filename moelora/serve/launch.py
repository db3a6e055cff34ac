"""Starting `moelora serve` / `moelora run-batch` from parsed flags: the oracle's verdict
printed, the weights and adapters loaded, the decode engine warmed, the scheduler running,
and (serve) the ASGI app under uvicorn. The commands parse flags; this module runs them
(Ray Serve's replicas start their engines through start(), serve/ray.py).

serve binds its port before any weight is read (a port in use is refused at once, exit 2),
and a signal (SIGTERM, or Ctrl-C) stops the scheduler from accepting at once: queued
requests are refused (503), running ones get --shutdown-timeout seconds, then are cancelled
with a 503 error their clients read; the process exits 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
from pathlib import Path

import torch

from ..errors import ConfigError

# Seconds a connection may take to send a whole request head, and then each part of its
# body: a client slower than this holds a connection for nothing (uvicorn waits forever).
HEAD_TIMEOUT_S = 30.0
BODY_READ_TIMEOUT_S = 30.0
# uvicorn's wait for open responses after a signal, past --shutdown-timeout: the time the
# cancelled rows' error bodies need to be written.
SHUTDOWN_MARGIN_S = 5.0


def settings_of(args: argparse.Namespace):
    from .model_dir import DecodeRunner, LoadFormat, ServeSettings, parse_lora_modules

    return ServeSettings(
        model=Path(args.model), lora_modules=parse_lora_modules(args.lora_modules),
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras, dtype=args.dtype, moe_backend=args.moe_backend,
        enforce_eager=args.enforce_eager, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
        chat_template=getattr(args, "chat_template", None),
        load_format=LoadFormat(getattr(args, "load_format", "auto")),
        decode_runner=DecodeRunner(getattr(args, "decode_runner", "auto")),
        block_size=getattr(args, "block_size", 16),
        num_gpu_blocks_override=getattr(args, "num_gpu_blocks_override", None),
        enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
    )  # fmt: skip


def start(args: argparse.Namespace, model=None):
    """The ServeContext: verdict printed, weights loaded, the scheduler thread running.
    model: weights already on the device instead of MODEL_DIR's (model_dir.load)."""
    _need_serve_extra()
    _interpret_without_gpu()
    from . import model_dir
    from .context import ServeContext
    from .metrics import Metrics, Setting, cache_config_of, paged_cache_of
    from .scheduler import Scheduler
    from .watchdog import StallWatchdog

    settings = settings_of(args)
    allowed = _allowed_root(getattr(args, "allowed_local_lora_path", None))
    print(f"moelora {args.command}: {model_dir.preflight(settings)}", flush=True)
    if getattr(args, "seed", None) is not None:
        torch.manual_seed(args.seed)  # requests without a seed draw from this generator
    handle, tokenizer = model_dir.load(settings, model)
    engine = _engine(args, settings, handle)
    report = engine.warmup()  # every decode graph captured before the first request (GPU)
    if report is not None:
        print(f"moelora {args.command}: {report}", flush=True)
    if engine.device.type == "cuda":  # prompt steps' kernels compiled before the first request
        _warm_prompts(args, engine, handle)
    name = getattr(args, "served_model_name", None) or args.model
    metrics = Metrics(Setting(name, settings.max_loras, engine.max_rows,
                              is_loaded=lambda adapter: handle.version(adapter) is not None,
                              kv_cache=paged_cache_of(engine), max_model_len=engine.max_len,
                              cache_config=cache_config_of(engine, settings)))  # fmt: skip
    scheduler = Scheduler(engine, metrics, admission=_admission(args, engine)).start()
    stall_s = getattr(args, "stall_dump_seconds", 0.0)  # serve's flag; run-batch: off
    StallWatchdog(scheduler.snapshot, stall_s, metrics, lambda: scheduler.alive).start()
    parents = {n: m.base_model_name for n, m in settings.lora_modules.items()
               if m.base_model_name}  # fmt: skip
    return ServeContext(
        handle, scheduler, tokenizer, name,
        api_key=getattr(args, "api_key", None),
        runtime_lora=getattr(args, "enable_runtime_lora", False),
        allowed_lora_root=allowed, parents=parents, metrics=metrics,
    )  # fmt: skip


def _admission(args: argparse.Namespace, engine):
    """The scheduler's admission policy: the default, with --adapter-preemption its
    preempting form (refused on an engine without the paged cache: it cannot suspend)."""
    from .admission import AdmissionPolicy

    if not getattr(args, "adapter_preemption", False):
        return AdmissionPolicy()
    if engine.pool is None:
        raise ConfigError(
            "--adapter-preemption", True, "an engine on the decode runner's paged cache",
            "drop --adapter-preemption: this model runs on transformers' forward "
            "(--decode-runner off, or a family the runner does not know)",
        )  # fmt: skip
    return AdmissionPolicy(preempt=True)


def _interpret_without_gpu() -> None:
    """No GPU: Triton's interpreter runs the kernels (the decode runner's). Set before any
    kernel module is imported: Triton picks the interpreter when a kernel is defined."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _need_serve_extra() -> None:
    """A clear refusal, before any weight loads, when the serve extra is not installed."""
    import importlib.util

    from ..extras import EXTRA_OF

    needed = [m for m, extra in EXTRA_OF.items() if extra == "serve"]
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError("package", missing[0], "installed (the serve extra)",
                          "pip install 'moelora[serve]'")  # fmt: skip


def resolver_of(args: argparse.Namespace, ctx, root: Path | None):
    """--lora-resolver-dir's resolver over `root` (None without the flag): the adapters it
    loads must name the served model as given, its real path or --served-model-name as
    their base."""
    if root is None:
        return None
    from .resolver import LoraResolver

    bases = frozenset({ctx.served_model_name, str(args.model), str(Path(args.model).resolve())})
    return LoraResolver(root, ctx.handle, bases, ctx.metrics)


def resolver_root_of(args: argparse.Namespace) -> Path | None:
    """--lora-resolver-dir, checked before any weight is read: an existing directory, and
    under --allowed-local-lora-path when that is set (every adapter read while serving
    stays below it)."""
    value = getattr(args, "lora_resolver_dir", None)
    if value is None:
        return None
    root = Path(value).resolve()
    if not root.is_dir():
        raise ConfigError("--lora-resolver-dir", value, "an existing directory",
                          "create it, or pass the directory adapters are resolved from")  # fmt: skip
    allowed = _allowed_root(getattr(args, "allowed_local_lora_path", None))
    if allowed is not None and not root.is_relative_to(allowed):
        raise ConfigError("--lora-resolver-dir", value, f"a directory under "
                          f"--allowed-local-lora-path ({allowed})",
                          "move it there, or widen --allowed-local-lora-path")  # fmt: skip
    return root


def _allowed_root(value: str | None) -> Path | None:
    if value is None:
        return None
    root = Path(value).resolve()
    if not root.is_dir():
        raise ConfigError("--allowed-local-lora-path", value, "an existing directory",
                          "create it, or pass the directory runtime loads may read")  # fmt: skip
    return root


def warm_adapters(handle, most: int = 3) -> list[str | None]:
    """What the prompt warm-up runs: the base model, then the first loaded adapter of each
    kind (expert LoRA or not, the set of other modules with LoRA: each kind launches other
    kernel variants), at most `most` adapters."""
    chosen, kinds = [None], set()
    for name in handle.adapters:
        version = handle.version(name)
        kind = (version.experts, version.modules)
        if kind not in kinds and len(kinds) < most:
            kinds.add(kind)
            chosen.append(name)
    return chosen


def _warm_prompts(args, engine, handle) -> None:
    """engine.warm_prompts for warm_adapters(handle), its line printed; a failure is printed
    and the server starts without it (the engine is left as it was: a first request of a
    new length then compiles its kernels as it runs)."""
    adapters = warm_adapters(handle)
    print(f"moelora {args.command}: compiling prompt steps (synthetic prompts up to "
          f"{engine.max_num_batched_tokens} tokens for the base model and "
          f"{len(adapters) - 1} adapter(s))...", flush=True)  # fmt: skip
    try:
        warmed = engine.warm_prompts(adapters)
    except Exception as err:  # a warm-up must not stop the server
        print(f"moelora {args.command}: prompt warm-up failed ({type(err).__name__}: {err}); "
              "serving without it", flush=True)  # fmt: skip
        return
    if warmed is not None:
        print(f"moelora {args.command}: {warmed}", flush=True)


# --max-num-batched-tokens of `moelora serve` when not given: `vllm serve`'s default on a GPU
# of 70 GiB or more (its LLM class, like run-batch and the Engine, takes 16384): a step that
# carries prompt chunks stays about half as long for the rows decoding beside them
SERVE_BATCHED_TOKENS = 8192


def _engine(args, settings, handle):
    """The decode engine of the flags, its KV cache sized and described in one printed line.
    Refused: --decode-runner on for a model the runner does not know (why), and
    --num-gpu-blocks-override where the cache is not paged."""
    from ..engine import Engine
    from ..engine.runner import runner_support
    from . import kv_budget
    from .model_dir import DecodeRunner

    reasons = runner_support(handle.model)
    if settings.decode_runner is DecodeRunner.ON and reasons:
        raise ConfigError("--decode-runner", "on", "a model the decode runner knows: "
                          + "; ".join(reasons), "pass --decode-runner auto (or off): "
                          "transformers' forward decodes this model")  # fmt: skip
    max_len = settings.max_model_len or handle.model.config.max_position_embeddings
    batched = getattr(args, "max_num_batched_tokens", None)
    if batched is None and args.command == "serve":  # run-batch keeps the engine's 16384
        batched = SERVE_BATCHED_TOKENS
    size, source = _kv_size(settings, handle, max_len, batched)
    engine = Engine(handle, max_rows=size.rows, max_len=settings.max_model_len,
                    enforce_eager=settings.enforce_eager or None,
                    runner=settings.decode_runner.engine_value, max_num_batched_tokens=batched,
                    block_size=settings.block_size, num_blocks=size.num_blocks,
                    enable_prefix_caching=settings.enable_prefix_caching,
                    long_prefill_token_threshold=getattr(args, "long_prefill_token_threshold",
                                                         0))  # fmt: skip
    if engine.pool is None:
        why = _unpaged_why(settings, reasons)
        if settings.num_gpu_blocks_override is not None:
            engine.close()
            raise ConfigError("--num-gpu-blocks-override", settings.num_gpu_blocks_override,
                              "a paged KV cache to size, which only the decode runner keeps "
                              f"(this engine runs transformers' forward: {why})",
                              "leave --num-gpu-blocks-override out"
                              + ("" if reasons else ", or pass --decode-runner on"))  # fmt: skip
        line = (f"{kv_budget.describe(engine, max_len, source)} on transformers' forward "
                f"({why}): --block-size and --enable-prefix-caching apply to the decode "
                "runner's paged cache only")  # fmt: skip
    else:
        line = kv_budget.describe(engine, max_len, source)
    print(f"moelora {args.command}: {line}", flush=True)
    return engine


def _kv_size(settings, handle, max_len: int, batched: int | None):
    """(KvSize, the flag that sized it): --num-gpu-blocks-override over
    --gpu-memory-utilization (vLLM's order), else --max-num-seqs rows of --max-model-len."""
    from . import kv_budget

    rows, blocks = settings.max_num_seqs, settings.num_gpu_blocks_override
    if blocks is not None:
        return kv_budget.KvSize(rows, blocks), f"--num-gpu-blocks-override {blocks}"
    utilization = settings.gpu_memory_utilization
    if utilization is None:
        return kv_budget.KvSize(rows, None), "--max-num-seqs x --max-model-len"
    size = kv_budget.engine_size(
        handle, max_len, rows, utilization, runner=settings.decode_runner.engine_value,
        block_size=settings.block_size, max_num_batched_tokens=batched,
        prefix_caching=settings.enable_prefix_caching,
    )  # fmt: skip
    return size, f"--gpu-memory-utilization {utilization}"


def _unpaged_why(settings, reasons: list[str]) -> str:
    """Why the engine runs transformers' forward (its KV cache one slab per row)."""
    from .model_dir import DecodeRunner

    if settings.decode_runner is DecodeRunner.OFF:
        return "--decode-runner off"
    if reasons:
        return "the decode runner does not know this model: " + "; ".join(reasons)
    return "no CUDA GPU: --decode-runner auto runs the decode runner on one, on runs it here"


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads (uvicorn's options: SO_REUSEADDR,
    inheritable); a port that cannot be bound is refused naming --host / --port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ConfigError("--host / --port", f"{host}:{port}", "an address this machine can "
                          f"listen on ({err.strerror or err})",
                          "pick another --port, or stop what listens there") from None  # fmt: skip
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace, model=None) -> int:
    _interpret_without_gpu()  # before the app's imports reach the engine's kernels
    import uvicorn

    from .app import build_app
    from .limits import timed_h11

    sock = bind(args.host, args.port)
    try:
        resolver_root = resolver_root_of(args)
        ctx = start(args, model)
    except BaseException:
        sock.close()
        raise
    resolver = resolver_of(args, ctx, resolver_root)
    app = build_app(ctx, args.shutdown_timeout, BODY_READ_TIMEOUT_S, resolver)
    config = uvicorn.Config(
        app, log_level="warning", http=timed_h11(HEAD_TIMEOUT_S),
        timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_MARGIN_S,
    )  # fmt: skip
    server = _server_class()(config)
    server.on_signal = lambda: ctx.scheduler.begin_stop(args.shutdown_timeout)
    print(f"moelora serve: {ctx.models[0]} and adapters {ctx.models[1:]} on "
          f"http://{args.host}:{args.port}/v1", flush=True)  # fmt: skip
    server.run(sockets=[sock])  # returns after SIGTERM / SIGINT, once shut down
    ctx.scheduler.stop(0.0)  # idempotent: the app's shutdown already stopped it
    ctx.scheduler.engine.close()
    return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """A signal starts the scheduler's stop at once (so the grace period and uvicorn's
        wait for open responses run together), and is not re-raised after the graceful
        shutdown (uvicorn re-raises it: the process would die of it, with a traceback for
        SIGINT): a stop the operator asked for is a clean exit, code 0, as vLLM's."""

        on_signal = None

        def handle_exit(self, sig: int, frame) -> None:
            if self.on_signal is not None:
                self.on_signal()
            super().handle_exit(sig, frame)
            if sig in (signal.SIGTERM, signal.SIGINT):
                while sig in self._captured_signals:
                    self._captured_signals.remove(sig)

    return Server
