"""Compile ahead: the Triton kernel variants some work launches, compiled in parallel before
it runs for real.

Triton compiles a kernel variant (its constexprs, the divisibility of its pointers and ints,
its warps and stages) at the variant's first launch, one at a time. A cold start of the
Qwen3-30B-A3B runner launches 57 variants over its decode and prompt-step buckets; compiling
them one after another took 23.6 s on a 2-core machine, 11.6 s in two threads (Triton's
compiler leaves the GIL in its native stages), and ~24 s of the 48-layer model's 36 s of
graph capture on the H200 (its capture took 11 s with Triton's cache warm).

`recording(on_launch)`: every moelora kernel the calling thread launches inside calls
on_launch(kernel, grid, arguments) instead of running (its outputs are left as they were:
the work's later torch ops read whatever they hold, so the work must be one whose torch ops
index only with its own inputs, as the runner's steps do); other threads' launches run.
`compile_all(launches)`: each recorded launch's variant compiled by Triton's own launch
path (`kernel.warmup`, the JIT's binder and cache keys) under its AsyncCompileMode, one
compile per variant in a thread pool; the kernels' caches
then hold every variant, and the real launches compile nothing. `Distinct` keeps one
launch a variant (a step's 48 layers launch each kernel alike)."""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

Launch = tuple  # (kernel, grid, {argument name: value})


_RECORDING = threading.Lock()  # one recording at a time: the kernels are swapped module-wide


@contextlib.contextmanager
def recording(on_launch: Callable[[object, object, dict], None]) -> Iterator[None]:
    """Every moelora.kernels `*_kernel` JIT function launched by this thread calls
    on_launch(kernel, grid, kwargs) instead of running; kwargs names its positional
    arguments as the kernel does. The kernels are swapped module-wide for the block, one
    recording at a time (another waits): other threads' launches go through to the kernel
    (an engine generating beside a warmup)."""
    from triton.runtime.jit import KernelInterface

    pkg = importlib.import_module(__package__)  # moelora.kernels
    me = threading.get_ident()

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            if threading.get_ident() != me:
                return self.fn[grid]
            names = self.fn.arg_names  # a JITFunction's, or the interpreter's wrapper's

            def launch(*args, **kwargs):
                on_launch(self.fn, grid, {**dict(zip(names, args)), **kwargs})

            return launch

        def __getattr__(self, name):  # warmup, arg_names, ...: the kernel's own
            return getattr(self.fn, name)

    with _RECORDING:
        # every module imported before any swap: a module importing another's kernel by
        # name (mla_attention's _combine_kernel) must bind the kernel, not a Recorder
        modules = [importlib.import_module(f"{pkg.__name__}.{info.name}")
                   for info in pkgutil.iter_modules(pkg.__path__)]  # fmt: skip
        swapped = []
        try:
            for module in modules:
                for name, obj in list(vars(module).items()):
                    if isinstance(obj, KernelInterface) and name.endswith("_kernel"):
                        swapped.append((module, name, obj))
                        setattr(module, name, Recorder(obj))
            yield
        finally:
            for module, name, obj in swapped:
                setattr(module, name, obj)


class Distinct:
    """Recorded launches, one kept per variant they may compile: launches of one kernel with
    equal scalars and tensors of equal dtype and 16-byte alignment (what Triton specializes
    a pointer on; strides and sizes reach it as scalars) are one, so a step's layers keep
    one launch each and the tensors of the others are not held. `add` is an on_launch."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self.seen = 0
        self._keys: set = set()

    def add(self, fn, grid, kwargs: dict) -> None:
        self.seen += 1
        key = (id(fn), *((name, _variant_key(v)) for name, v in sorted(kwargs.items())))
        if key not in self._keys:
            self._keys.add(key)
            self.launches.append((fn, grid, kwargs))


def _variant_key(value):
    import torch

    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, (bool, int, float, str)) or value is None:
        return (type(value), value)
    return ("object", id(value))  # a TensorDescriptor, a tuple of them: never merged


def wanted(device) -> bool:
    """Whether work on `device` compiles ahead: on CUDA, unless MOELORA_COMPILE_AHEAD=0."""
    return device.type == "cuda" and os.environ.get("MOELORA_COMPILE_AHEAD") != "0"


def compile_all(launches: list[Launch], workers: int | None = None) -> int:
    """Compile every variant `launches` name, in `workers` threads (default: this process's
    CPUs, at most 16), and build each compiled kernel's launcher there too (Triton 3.6 builds
    a C launcher per signature with the host compiler at a kernel's first launch); returns
    the number of launches handed to Triton. A launch whose variant is compiled already costs
    its binder only; under the interpreter (no compiler) nothing happens. A variant whose
    compile fails is left to its first launch, which raises as it would have."""
    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction

    if not hasattr(_async_compile, "AsyncCompileMode"):  # the launches compile as they come
        return 0
    compiled = [(fn, grid, kw) for fn, grid, kw in launches if isinstance(fn, JITFunction)]
    if not compiled:
        return 0
    workers = workers or min(16, len(os.sched_getaffinity(0)))
    with ThreadPoolExecutor(workers, thread_name_prefix="moelora-compile") as pool:
        mode = _async_compile.AsyncCompileMode(pool, ignore_errors=True)
        try:
            with mode:
                kernels = [fn.warmup(grid=grid, **kwargs) for fn, grid, kwargs in compiled]
        finally:  # (Triton 3.6 leaves the mode set when a result raises: later compiles
            # would go to this pool, shut down below)
            if _async_compile.active_mode.get() is mode:
                _async_compile.active_mode.set(None)
        done = {id(k): k for k in (_result(k) for k in kernels) if k is not None}
        list(pool.map(_build_launcher, done.values()))
    return len(compiled)


def _result(kernel):
    """The CompiledKernel a warmup returned (Triton's FutureKernel resolved), or None."""
    if kernel is not None and hasattr(kernel, "result"):
        return kernel.result(ignore_errors=True)
    return kernel


def _build_launcher(kernel) -> None:
    """Build (and cache on disk) the kernel's launcher as its first launch would; no CUDA
    call. A failure is left to that launch."""
    from triton.runtime import driver

    try:
        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # the first launch builds it again and raises there
        pass
