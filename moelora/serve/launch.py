"""Starting `moelora serve` / `moelora run-batch` from parsed flags: the oracle's verdict
printed, the weights and adapters loaded, the decode engine warmed, the scheduler running,
and (serve) the ASGI app under uvicorn. The commands parse flags; this module runs them, so
tools (benchmarks/serve_load.py) start a server without importing the CLI.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch

from ..errors import ConfigError


def settings_of(args: argparse.Namespace):
    from .model_dir import ServeSettings, parse_lora_modules

    return ServeSettings(
        model=Path(args.model), lora_modules=parse_lora_modules(args.lora_modules),
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras, dtype=args.dtype, moe_backend=args.moe_backend,
        enforce_eager=args.enforce_eager, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
    )  # fmt: skip


def start(args: argparse.Namespace, model=None):
    """The ServeContext: verdict printed, weights loaded, the scheduler thread running.
    model: weights already on the device instead of MODEL_DIR's (model_dir.load)."""
    _need_serve_extra()
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # no GPU: Triton's interpreter
    from . import model_dir
    from .context import ServeContext
    from .metrics import Metrics
    from .scheduler import Scheduler

    settings = settings_of(args)
    print(f"moelora {args.command}: {model_dir.preflight(settings)}", flush=True)
    handle, tokenizer = model_dir.load(settings, model)
    from ..hf.engine import Engine

    rows = _engine_rows(args, settings, handle)
    engine = Engine(handle, max_rows=rows, max_len=settings.max_model_len,
                          enforce_eager=settings.enforce_eager or None)  # fmt: skip
    report = engine.warmup()  # every decode graph captured before the first request (GPU)
    if report is not None:
        print(f"moelora {args.command}: {report}", flush=True)
    metrics = Metrics()
    scheduler = Scheduler(engine, metrics).start()
    name = getattr(args, "served_model_name", None) or args.model
    return ServeContext(
        handle, scheduler, tokenizer, name,
        api_key=getattr(args, "api_key", None),
        runtime_lora=getattr(args, "enable_runtime_lora", False), metrics=metrics,
    )  # fmt: skip


def _need_serve_extra() -> None:
    """A clear refusal, before any weight loads, when the serve extra is not installed."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "tqdm") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError("package", missing[0], "installed (the serve extra)",
                          "pip install 'moelora[serve]'")  # fmt: skip


def _engine_rows(args, settings, handle) -> int:
    """--max-num-seqs, or what --gpu-memory-utilization leaves room for (printed)."""
    if settings.gpu_memory_utilization is None:
        return settings.max_num_seqs
    from . import kv_budget

    max_len = settings.max_model_len or handle.model.config.max_position_embeddings
    rows = kv_budget.engine_rows(
        handle, max_len, settings.max_num_seqs, settings.gpu_memory_utilization
    )
    print(f"moelora {args.command}: KV cache of {rows} rows x {max_len} positions under "
          f"--gpu-memory-utilization {settings.gpu_memory_utilization}", flush=True)  # fmt: skip
    return rows


def run(args: argparse.Namespace, model=None) -> int:
    import uvicorn

    from .app import build_app

    ctx = start(args, model)
    app = build_app(ctx, shutdown_grace_s=args.shutdown_timeout)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout)  # fmt: skip
    print(f"moelora serve: {ctx.models[0]} and adapters {ctx.models[1:]} on "
          f"http://{args.host}:{args.port}/v1", flush=True)  # fmt: skip
    _server_class()(config).run()  # returns after SIGTERM / SIGINT, once shut down
    ctx.scheduler.stop(0.0)  # idempotent: the app's shutdown already stopped it
    ctx.scheduler.engine.close()
    return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM after its graceful shutdown (the process then dies of
        it); a stop the operator asked for is a clean exit here: code 0, as vLLM's."""

        def handle_exit(self, sig: int, frame) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)

    return Server
