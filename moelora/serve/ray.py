"""Many moelora engines behind Ray Serve, each request routed to a replica that holds its
adapter by Ray Serve's model multiplexing: `moelora serve MODEL_DIR --ray-replicas N`, or
`application(args)` for `serve.run` (docs/serve.md, "Behind a router").

Two deployments, as Ray Serve LLM builds them (an ingress, then the engines):
- `MoeloraEngine`: N replicas, each one moelora engine (one GPU when the cluster has GPUs)
  answering with `moelora serve`'s own app (serve/app.py, driven in-process by asgi_call.py).
  Its adapters are Ray's multiplexed models: the loader
  (`@serve.multiplexed(max_num_models_per_replica=--max-loras)`) loads the adapter named by
  the multiplexed model id into the engine; Ray's LRU eviction unloads it (its slot and
  host copy freed) once the requests that named it on this replica have ended.
- `MoeloraIngress`: the HTTP entry behind Ray's proxy. It reads a request's body, and when
  its `model` is an adapter of --lora-modules, sends it on with that multiplexed model id:
  Ray's router picks a replica that holds the adapter (else one holding the fewest, which
  loads it). Any other request (the base model, a refusal, /health, /metrics) goes to any
  replica. Clients see `moelora serve`'s routes and answers unchanged; each response names
  its replica (`x-moelora-replica`) and, for an adapter, how many times that replica has
  loaded it (`x-moelora-adapter-loads`).

Imports Ray at import time: without it, importing this module raises the ConfigError that
names `pip install 'moelora[ray]'`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import threading
import time
from collections import Counter
from pathlib import Path

from ..errors import ConfigError
from ..extras import missing_extra
from . import asgi_call
from .asgi_call import HttpRequest
from .context import ServeContext
from .ray_ingress import Relay, error_messages

try:
    import ray
    from ray import serve
except ModuleNotFoundError as _err:  # the `ray` extra: one error naming it
    raise (missing_extra(_err) or _err) from None

log = logging.getLogger("moelora.serve")

ENGINE = "MoeloraEngine"
INGRESS = "MoeloraIngress"
APP = "moelora"


def application(args: argparse.Namespace, replicas: int | None = None,
                gpus_per_replica: float | None = None) -> serve.Application:  # fmt: skip
    """The Ray Serve application of `moelora serve`'s parsed flags (`args`, as
    `moelora.cli.build_parser().parse_args(["serve", MODEL_DIR, ...])` returns them):
    `replicas` engines (default: args.ray_replicas), each with `gpus_per_replica` GPUs
    (default: 1 when the connected Ray cluster, or else this machine, has a GPU; 0 runs on a
    CPU). --lora-modules is the table of adapters replicas load on demand."""
    from .model_dir import parse_lora_modules

    _refuse_unroutable(args)
    replicas = replicas if replicas is not None else getattr(args, "ray_replicas", None) or 1
    adapters = frozenset(parse_lora_modules(args.lora_modules))
    gpus = _gpus() if gpus_per_replica is None else gpus_per_replica
    resources = {"num_gpus": gpus} if gpus else {"num_cpus": 1}
    in_flight = 2 * args.max_num_seqs  # as run-batch: more queued would start nothing sooner
    engine = serve.deployment(_engine_class(args.max_loras), name=ENGINE).options(
        num_replicas=replicas, ray_actor_options=resources, max_ongoing_requests=in_flight,
        graceful_shutdown_timeout_s=args.shutdown_timeout, health_check_period_s=10,
    )  # fmt: skip
    ingress = serve.deployment(serve.ingress(Relay(adapters, ENGINE))(_Ingress), name=INGRESS).options(
        num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=replicas * in_flight,
    )  # fmt: skip
    return ingress.bind(engine.bind(args))


def run(args: argparse.Namespace) -> int:
    """`moelora serve --ray-replicas N`: a local Ray cluster (or the one RAY_ADDRESS names),
    Ray's HTTP proxy on --host / --port, the application until SIGTERM / Ctrl-C, then Ray
    Serve shut down (running requests get --shutdown-timeout seconds)."""
    from .launch import bind
    from .model_dir import parse_lora_modules

    bind(args.host, args.port).close()  # a port in use is refused now, naming --port
    _refuse_unroutable(args)
    for name, module in parse_lora_modules(args.lora_modules).items():  # as `moelora serve`
        if not (module.path / "adapter_config.json").is_file():
            raise ConfigError("--lora-modules", f"{name}={module.path}",
                              "a PEFT adapter directory (adapter_config.json)")  # fmt: skip
    ray.init(logging_level=logging.WARNING)
    stop = _StopSignals()  # after ray.init, whose own handlers exit the process at once
    try:
        app = application(args)  # its GPUs: the cluster's
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=APP, route_prefix="/")
        print(f"moelora serve: {args.served_model_name or args.model} on {args.ray_replicas} "
              f"Ray Serve replicas, http://{args.host}:{args.port}/v1", flush=True)  # fmt: skip
        stop.wait()
    except _Stopped:
        pass  # stopped while starting: a normal stop
    finally:
        stop.stopping()
        serve.shutdown()
        ray.shutdown()
    return 0


def _refuse_unroutable(args: argparse.Namespace) -> None:
    """Flags that would load an adapter on one replica behind Ray's back: the router would
    never learn it is there."""
    for flag, value in (("--enable-runtime-lora", getattr(args, "enable_runtime_lora", False)),
                        ("--lora-resolver-dir", getattr(args, "lora_resolver_dir", None))):  # fmt: skip
        if value:
            raise ConfigError(flag, value, "not set with --ray-replicas (replicas load "
                              "adapters when Ray Serve routes a request of one to them)",
                              "list the adapters in --lora-modules, or serve without Ray")  # fmt: skip


def _gpus() -> float:
    if ray.is_initialized():
        return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    import torch

    return 1.0 if torch.cuda.is_available() else 0.0


class _Stopped(BaseException):
    """SIGTERM / SIGINT while the application starts (as KeyboardInterrupt: no `except
    Exception` on the way catches it)."""


class _StopSignals:
    """SIGTERM and SIGINT from ray.init on. Ray's proxy answers before `serve.run` returns
    (it waits for every replica), so a signal can come while it still waits: it then
    raises _Stopped there. Once `wait` has begun, a signal ends the wait; once `stopping`
    has been called, it is only recorded (the shutdown runs to its end)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.starting = True
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, *_) -> None:
        self.event.set()
        if self.starting:
            self.starting = False
            raise _Stopped

    def wait(self) -> None:
        self.starting = False
        self.event.wait()

    def stopping(self) -> None:
        self.starting = False


# ---- the engine replicas ------------------------------------------------------------------


@dataclasses.dataclass
class _ReplicaContext(ServeContext):
    """A replica's serving context: the names it serves are the deployment's (every adapter
    of --lora-modules), not only those it holds now, so /v1/models and a 404's list of names
    are the same from every replica."""

    deployment_adapters: tuple[str, ...] = ()

    @property
    def models(self) -> list[str]:
        return [self.served_model_name, *self.deployment_adapters]


class ReplicaAdapters:
    """The adapters of one replica's engine (`handle`), as Ray's multiplexer moves them:
    loaded by Ray's loader, unloaded at Ray's eviction unless requests of the adapter are
    still in flight here, then when the last of them ends (a request that found its adapter
    loaded may still wait in the engine's queue, and an unload would refuse it). The loader
    and the eviction run in worker threads, the requests in the event loop: one lock.
    `paths`: each adapter's PEFT directory (--lora-modules)."""

    def __init__(self, handle, paths: dict[str, Path], metrics=None) -> None:
        self.handle, self.paths, self.metrics = handle, paths, metrics
        self.loads: Counter[str] = Counter()  # adapter -> times this replica read it
        self._resident: set[str] = set()  # Ray's multiplexer holds it here
        self._in_flight: Counter[str] = Counter()
        self._lock = threading.Lock()

    def load(self, name: str) -> None:
        """Ray's loader: the adapter into the engine, unless it is still there (evicted,
        but its requests have not ended)."""
        with self._lock:
            self._resident.add(name)
            if name in self.handle.adapters:
                return
        started = time.perf_counter()
        try:
            self.handle.load_adapter(self.paths[name], name=name)
        except BaseException:
            with self._lock:
                self._resident.discard(name)
            raise
        self.loads[name] += 1
        if self.metrics is not None:
            self.metrics.adapter(loaded=True)
            self.metrics.adapter_loaded("multiplexed", time.perf_counter() - started)

    def evicted(self, name: str) -> None:
        """Ray's LRU eviction."""
        with self._lock:
            self._resident.discard(name)
        self._unload_if_idle(name)

    def enter(self, name: str) -> None:
        """A request of `name` starts here: the adapter stays until its leave()."""
        with self._lock:
            self._in_flight[name] += 1

    def leave(self, name: str) -> None:
        with self._lock:
            self._in_flight[name] -= 1
        self._unload_if_idle(name)

    def _unload_if_idle(self, name: str) -> None:
        with self._lock:  # held while unloading: a load of the name waits for it
            if name in self._resident or self._in_flight[name]:
                return
            if name in self.handle.adapters:
                self.handle.unload_adapter(name)  # its slot and host copy freed
                if self.metrics is not None:
                    self.metrics.adapter(loaded=False)


class _Held:
    """What Ray's multiplexer caches per adapter: its eviction calls __del__ (in a worker
    thread), which unloads the adapter once; the garbage collector's later call does nothing."""

    def __init__(self, held: ReplicaAdapters, name: str) -> None:
        self.held, self.name, self._released = held, name, False

    def __del__(self) -> None:
        if not self._released:
            self._released = True
            self.held.evicted(self.name)


class _Engine:
    """One replica: one moelora engine and `moelora serve`'s app over it, adapters loaded
    when Ray routes a request of one here. The multiplexed loader (`adapter`) is added by
    _engine_class, which knows --max-loras."""

    def __init__(self, args: argparse.Namespace) -> None:
        from .app import build_app
        from .launch import BODY_READ_TIMEOUT_S, start
        from .model_dir import parse_lora_modules

        table = parse_lora_modules(args.lora_modules)
        own = argparse.Namespace(**vars(args))
        own.lora_modules = []  # none at start: each comes when Ray routes a request of it here
        ctx = start(own)
        fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx) if f.init}
        self.ctx = _ReplicaContext(**fields, deployment_adapters=tuple(sorted(table)))
        self.app = build_app(self.ctx, args.shutdown_timeout, BODY_READ_TIMEOUT_S)
        paths = {n: m.path for n, m in table.items()}
        self.held = ReplicaAdapters(ctx.handle, paths, ctx.metrics)
        self.replica = str(serve.get_replica_context().replica_id.unique_id)

    async def _load(self, name: str) -> _Held:
        if name not in self.held.paths:  # the ingress routes only --lora-modules' names
            raise ValueError(f"adapter {name!r} is not in --lora-modules")
        await asyncio.to_thread(self.held.load, name)
        return _Held(self.held, name)

    async def relay(self, request: HttpRequest):
        """One HTTP request through this replica's app: the ASGI messages it sends, with the
        replica's headers added to the response's start."""
        name = serve.get_multiplexed_model_id()
        headers = [(b"x-moelora-replica", self.replica.encode())]
        if name:
            try:
                await self.adapter(name)  # cached: no suspension before enter() below
            except Exception as err:
                log.warning("replica %s: adapter %r not loaded: %r", self.replica, name, err)
                for message in error_messages(500, f"adapter {name!r} could not be loaded: {err}",
                                      "InternalServerError", "model", headers):  # fmt: skip
                    yield message
                return
            self.held.enter(name)
            headers.append((b"x-moelora-adapter-loads", b"%d" % self.held.loads[name]))
        try:
            async for message in asgi_call.call(self.app, request):
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", ()), *headers]}
                yield message
        finally:
            if name:
                await asyncio.to_thread(self.held.leave, name)

    def max_body_bytes(self) -> int:
        """The largest body this replica's app reads (the ingress reads no more)."""
        from .limits import body_limit

        return body_limit(self.ctx.max_model_len)

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread ended is replaced."""
        scheduler = self.ctx.scheduler
        if not scheduler.alive:
            raise RuntimeError(f"the engine thread has ended: {scheduler.fault!r}")

    def __del__(self) -> None:
        """Ray Serve's shutdown of this replica (after graceful_shutdown_timeout_s for its
        requests), and the garbage collector's call after it."""
        ctx = self.__dict__.pop("ctx", None)
        if ctx is not None:
            ctx.scheduler.stop(0.0)
            ctx.scheduler.engine.close()


def _engine_class(max_adapters: int) -> type:
    """The replica class with its multiplexed loader: at most `max_adapters` (--max-loras:
    one device slot each) adapters held per replica."""

    class MoeloraEngine(_Engine):
        @serve.multiplexed(max_num_models_per_replica=max_adapters)
        async def adapter(self, name: str) -> _Held:
            return await self._load(name)

    return MoeloraEngine


# ---- the ingress --------------------------------------------------------------------------


class _Ingress:
    """The ingress replica; its ASGI app (ray_ingress.Relay) does the work. `engine` makes Ray deploy
    the engines with it."""

    def __init__(self, engine) -> None:
        self.engine = engine
