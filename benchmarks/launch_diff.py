"""Whether two trees launch the same kernels with the same arguments, without a GPU.

Every `*_kernel` JIT function of moelora.kernels is swapped for a recorder (as
tests/sm90_launches.py does), and the triton backend's forward runs on CPU tensors that are
never read, for a table of cases: picked configs on the Qwen3-30B-A3B shape at every T of
the bench, and explicit configs with each knob on, in bf16 and fp32, gated, interleaved
and non-gated activations, biases, weights on the input, PDL, fully sharded LoRA. Each
launch is recorded as its kernel, grid, constexprs, scalars and tensor shapes / strides /
dtypes, less the arguments passed at the kernel's own default (so a knob added off, as a
defaulted constexpr, launches as the tree before it did), an argument group (a NamedTuple
passed as one Triton tuple) spread into its fields. Same kernel sources and the same
records mean the same compiled code: a refactor of the host side can be checked against
the tree it came from before any GPU run. A knob case whose knob one tree lacks runs in the
other only and is counted apart.

Usage: python -m benchmarks.launch_diff --base .ab_base  (a tree exported by git archive)
       python -m benchmarks.launch_diff --dump FILE      (this tree's records, as JSON)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import json
import os
import pkgutil
import subprocess
import sys

QWEN3 = (128, 8, 2048, 768)
BENCH_T = (1, 2, 4, 8, 16, 64, 256, 1024, 4096, 16384)
KNOB_CASES = [
    {},
    {"decode": True},
    {"decode": True, "pdl": True},
    {"lora_delta": True},
    {"lora_delta": True, "delta_in_reduce": True},
    {"lora_delta": True, "shrink_expand": True},
    {"lora_delta": True, "delta_in_reduce": True, "atomic_reduce": True},
    {"atomic_reduce": True},
    {"z_sorted": True},
    {"down_tma": True},
    {"up_tma": True, "z_sorted": True, "down_tma": True},
    {"half_tail": 1},
    {"half_tail": 2},
    {"half_tail": 3, "expand_first": True},
    {"expand_first": True, "expand_lanes": 64},
    {"pdl": True},
    {"expand_one_dot": True},
    {"expand_one_dot": True, "expand_first": True},
    {"expand_one_dot": True, "lora_delta": True},
    {"expand_one_dot": True, "lora_delta": True, "shrink_expand": True},
    {"expand_one_dot": True, "lora_stream": True, "shrink_expand": True},
]


def _value(v):
    import torch

    if isinstance(v, torch.Tensor):
        return ["tensor", list(v.shape), list(v.stride()), str(v.dtype)]
    if type(v).__name__ == "TensorDescriptor":
        return ["desc", _value(v.base), list(v.block_shape)]
    if isinstance(v, (int, float, bool, str)) or v is None:
        return v
    return repr(v)


@contextlib.contextmanager
def kernels_recording(on_launch):
    """Every moelora.kernels `*_kernel` JIT function calls on_launch(fn, grid, kwargs) for
    each launch instead of running (tests/sm90_launches.py records with it too). Not
    moelora.kernels.compile_ahead.recording: this tool also records trees from before it."""
    from triton.runtime.jit import JITFunction

    import moelora.kernels as pkg

    swapped = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):  # positional arguments named as the kernel names them
                on_launch(self.fn, grid, {**dict(zip(self.fn.arg_names, args)), **kwargs})

            return launch

    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for name, obj in list(vars(module).items()):
            if isinstance(obj, JITFunction) and name.endswith("_kernel"):
                swapped.append((module, name, obj))
                setattr(module, name, Recorder(obj))
    try:
        yield
    finally:
        for module, name, obj in swapped:
            setattr(module, name, obj)


@contextlib.contextmanager
def _recorded():
    """Yields the list of launches: [kernel name, grid, {argument: _value}]."""
    calls = []

    def record(fn, grid, kwargs):
        g = grid(kwargs) if callable(grid) else grid
        given = _fields(_given(fn, kwargs))
        calls.append([fn.__name__, list(g), {k: _value(v) for k, v in sorted(given.items())}])

    with kernels_recording(record):
        yield calls


def _given(fn, kwargs: dict) -> dict:
    """kwargs without the arguments passed at the kernel's own default: a launch with a
    parameter at its default compiles and runs as one without it, so a tree that adds a
    defaulted constexpr (a knob, off) launches the same as the tree before it."""
    params = inspect.signature(fn.fn).parameters
    return {
        k: v
        for k, v in kwargs.items()
        if k not in params
        or params[k].default is inspect.Parameter.empty
        or not _same(v, params[k].default)
    }


def _fields(kwargs: dict) -> dict:
    """kwargs with each NamedTuple argument (a group the kernel takes as one Triton tuple,
    moelora/kernels/launch_args.py) spread into its fields, which keep the names of the
    flat parameters they replaced: a tree that groups arguments records the same launch
    as one that passes them flat."""
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, tuple) and hasattr(v, "_fields"):
            out.update(v._asdict())
        else:
            out[k] = v
    return out


def _same(value, default) -> bool:
    """value is the default itself (a tensor never is: no kernel defaults one)."""
    return type(value) is type(default) and value == default


def _entry():
    """(fused_moe_lora, TileConfig, GemmTiles, pdl_on) of this tree: the
    package layout after the tiling/ split, or the one before it."""
    try:
        from moelora.backends import triton as backend
        from moelora.device import GpuLimits
        from moelora.tiling.config import GemmTiles, TileConfig

        def pdl_on():  # an sm_90 GPU's limits, for explicit configs (no fit)
            return _patched(backend, "gpu_limits", lambda device: GpuLimits(232448, 9))

        return _spelled_out(backend.fused_moe_lora), TileConfig, GemmTiles, pdl_on
    except ImportError:
        from moelora.kernels.configs import GemmTiles, TileConfig

        from moelora.kernels import moe_lora

        def pdl_on():
            return _patched(moe_lora, "pdl_active", lambda requested, device: requested)

        return moe_lora.fused_moe_lora, TileConfig, GemmTiles, pdl_on


def _spelled_out(fused):
    """The fused entry with the per-call record's fields as arguments (the trees' common
    form): a tree with moelora/call.py takes a record, one before it the fields."""
    try:
        from moelora.call import MoECall
    except ImportError:
        return fused

    def spelled(x, ids, w, slots, experts, bank, shape, *, lora_comm=None,
                weights_on_input=False, **kw):  # fmt: skip
        call = MoECall(x, ids, w, slots, bank, weights_on_input, lora_comm)
        return fused(call, experts, shape, **kw)

    return spelled


@contextlib.contextmanager
def _patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


class _Comm:
    """Fully sharded LoRA's collectives at tp = 2, shapes only."""

    hidden_offset = 0

    def gather_rank(self, u):
        import torch

        return torch.empty(u.shape[0], 2 * u.shape[1], dtype=u.dtype)

    def reduce_rank(self, v):
        return v


def _layer(dims, tokens, dtype, activation, lora, *, bias=False, slots_n=8, rank=16, tp=1):
    import torch

    from moelora.config import MoEShape
    from moelora.weights import ExpertWeights, LoRABank

    e, k, h, i = dims
    shape = MoEShape(e, k, h, i, activation, dtype=dtype)
    s = shape.activation.width_factor
    empty = lambda *size: torch.empty(*size, dtype=dtype)  # noqa: E731 (never read)
    biases = (empty(e, s * i), empty(e, h)) if bias else ()
    experts = ExpertWeights(empty(e, s * i, h), empty(e, h, i), *biases)
    bank = slots = None
    if lora:
        bank = LoRABank(
            empty(slots_n, e, s, rank // tp, h),
            empty(slots_n, e, s, i, rank),
            empty(slots_n, e, rank, i),
            empty(slots_n, e, h // tp, rank),
        )
        slots = (torch.arange(tokens) % (slots_n + 1) - 1).to(torch.int32)
    ids = (torch.arange(tokens * k) % e).view(tokens, k).to(torch.int32)
    return shape, experts, bank, empty(tokens, h), ids, torch.empty(tokens, k), slots


def dump() -> list:
    """The records of every case (module docstring), in case order."""
    import torch

    from moelora.activations import Activation

    fused, TileConfig, GemmTiles, pdl_on = _entry()
    out = []

    def run(label, dims, tokens, lora, cfg=None, dtype=torch.bfloat16, act=Activation.SILU,
            comm=None, woi=False, **layer):  # fmt: skip
        shape, experts, bank, x, ids, w, slots = _layer(
            dims, tokens, dtype, act, lora, tp=2 if comm else 1, **layer
        )
        with _recorded() as calls:
            fused(x, ids, w, slots, experts, bank, shape, config=cfg, lora_comm=comm,
                  weights_on_input=woi)  # fmt: skip
        out.append([label, calls])

    for t in BENCH_T:  # the picked configs (table rows and rules), both modes
        for lora in (False, True):
            run(f"picked T={t} lora={lora}", QWEN3, t, lora)
    small = (8, 4, 256, 128)
    base = TileConfig(32, GemmTiles(64, 64, 4, 3), GemmTiles(64, 64, 4, 2))
    for knobs in KNOB_CASES:
        if not all(hasattr(base, knob) for knob in knobs):
            continue  # a knob this tree lacks: the case is the other tree's only
        cfg = dataclasses.replace(base, **knobs)
        for t in (3, 70):
            for lora in (False, True):
                for dtype in (torch.bfloat16, torch.float32):
                    run(f"{knobs} T={t} lora={lora} {dtype}", small, t, lora, cfg, dtype)
                    if knobs.get("pdl"):
                        with pdl_on():
                            run(f"{knobs} T={t} lora={lora} {dtype} pdl-on", small, t, lora, cfg, dtype)  # fmt: skip
            run(f"{knobs} T={t} swigluoai bias", small, t, True, cfg, act=Activation.SWIGLUOAI, bias=True)  # fmt: skip
            run(
                f"{knobs} T={t} relu2 woi",
                small,
                t,
                True,
                cfg,
                act=Activation.RELU2_NO_MUL,
                woi=True,
            )
            run(f"{knobs} T={t} sharded", small, t, True, cfg, comm=_Comm())
            with pdl_on():
                run(f"{knobs} T={t} sharded pdl-on", small, t, True, cfg, comm=_Comm())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="another tree (exported) to compare this one with")
    p.add_argument("--dump", help="write this tree's records here (JSON)")
    args = p.parse_args()
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump(dump(), f)
        return 0
    if not args.base:
        p.error("--base or --dump")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    records = []
    for tree in (here, os.path.abspath(args.base)):
        path = os.path.join("/tmp", f"launch_diff_{os.getpid()}_{len(records)}.json")
        env = {**os.environ, "PYTHONPATH": tree, "TRITON_INTERPRET": "0"}
        env.pop("MOELORA_POISON_WORKSPACES", None)
        # this file by path (the other tree may not have it), that tree's package first
        cmd = [sys.executable, os.path.abspath(__file__), "--dump", path]
        subprocess.run(cmd, cwd="/tmp", env=env, check=True)
        with open(path) as f:
            records.append(json.load(f))
    new, old = (dict((label, calls) for label, calls in r) for r in records)
    both = [label for label in new if label in old]
    launches = sum(len(new[label]) for label in both)
    diffs = [label for label in both if new[label] != old[label]]
    for label in diffs:
        print(f"DIFFERENT: {label}")
    # cases with a knob only one tree has (a new knob's own cases): nothing to compare
    alone = [f"{len(new) - len(both)} only here", f"{len(old) - len(both)} only in --base"]
    print(f"launch_diff: {len(both)} cases, {launches} launches, {len(diffs)} different "
          f"({', '.join(alone)})")  # fmt: skip
    return 1 if diffs else 0


if __name__ == "__main__":
    raise SystemExit(main())
