"""PDL on the decode path (kernels/pdl.py): never planned without a Hopper GPU, and the
kernels' PDL branch, compiled for sm_90 here without a GPU, loads weights, signals its
dependents and waits before any load of a chain intermediate.

The branch cannot run in the interpreter (no griddepcontrol or prefetch there); its
results are validated on the GPU (`moelora validate` runs the table's decode rows). The
tests run under TRITON_INTERPRET=1, where the kernels are not compilable, so this file,
run as a script with the interpreter off, compiles them and prints their PTX as JSON."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import re
import textwrap

import pytest
import torch
import triton
from sm90_child import run_compile_child
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moelora.call import MoECall
from moelora.kernels.decode_down import _decode_down_kernel
from moelora.kernels.decode_shrink import _decode_shrink_kernel
from moelora.kernels.decode_up import _decode_up_kernel

BF16_PTRS = {"x_ptr", "w_ptr", "b_ptr", "z_ptr", "lora_b_ptr", "lora_a2_ptr", "a_ptr", "y_ptr"}
I32_PTRS = {"topk_ids_ptr", "slots_ptr"}
FLOATS = {"alpha", "limit"}


def _signature(fn, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*bf16" if name in BF16_PTRS else "*i32" if name in I32_PTRS else "*fp32"
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    return sig


def _compile(fn, constexprs: dict) -> list[str]:
    src = ASTSource(fn=fn, signature=_signature(fn, constexprs), constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return kernel.asm["ptx"].splitlines()


UP = dict(GATED=True, ACT=0, HAS_BIAS=False, HAS_LORA=True, WEIGHT_INPUT=False, BLOCK_N=2,
          BLOCK_K=256, BLOCK_R=16, EARLY=True, W_FP8=False, SCALE_N=128, SCALE_K=128,
          SCALE_COLUMNS=False, x_quant=None)  # fmt: skip
DOWN = dict(HAS_BIAS=False, HAS_LORA=True, MUL_WEIGHT=True, ADD=True, BLOCK_J=8, BLOCK_N=2,
            BLOCK_K=256, BLOCK_R=16, EARLY=True, W_FP8=False, SCALE_N=128,
            SCALE_K=128, SCALE_COLUMNS=False, z_quant=None)  # fmt: skip
SHRINK = dict(BLOCK_R=16, ROWS_PER_PROG=1, BLOCK_K=256, ZERO_BLOCK=16)
KERNELS = [(_decode_up_kernel, UP, True), (_decode_down_kernel, DOWN, True),
           (_decode_shrink_kernel, SHRINK, False)]  # fmt: skip
IDS = ["up", "down", "shrink"]


@pytest.fixture(scope="module")
def ptx() -> dict:
    """{(kernel id, PDL on): PTX lines}, compiled in a child process with the interpreter off."""
    result = run_compile_child(__file__, timeout=600)
    return {tuple(json.loads(k)): v for k, v in result.items()}


# chain intermediates: written by the kernel before in the layer (or by this one), so never
# read before the wait
INTERMEDIATES = {"inter_ptr", "z_inter_ptr", "z_ptr"}
INSTR = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)\s+(.*);")
REG = re.compile(r"%[a-z]+\d+")


def _params_of(lines: list[str]) -> dict[str, set[int]]:
    """For each PTX register, the kernel parameters (by index) its value derives from,
    through any instruction (PTX reuses registers in loops: the union over definitions)."""
    origin: dict[str, set[int]] = {}
    for _ in range(2):  # a second pass carries values defined after their use in a loop
        for line in lines:
            m = INSTR.match(line)
            if not m or m.group(1).startswith(("st.", "prefetch", "bra", "atom", "red.")):
                continue
            rest = m.group(2)
            if rest.startswith("{"):
                head, _, tail = rest.partition("}")
                dests, srcs = REG.findall(head), REG.findall(tail)
            else:
                regs = REG.findall(rest)
                dests, srcs = regs[:1], regs[1:]
            found = set().union(*(origin.get(r, set()) for r in srcs))
            found |= {int(i) for i in re.findall(r"_param_(\d+)", rest)}
            for d in dests:
                origin.setdefault(d, set()).update(found)
    return origin


def _first(lines: list[str], pattern: str) -> int:
    hits = [i for i, line in enumerate(lines) if re.search(pattern, line)]
    return hits[0] if hits else -1


@pytest.mark.parametrize("name,early_weights", list(zip(IDS, (True, True, False))))
def test_pdl_branch_loads_weights_then_signals_then_waits(ptx, name, early_weights) -> None:
    lines = ptx[(name, True)]
    # the main path's wait: the last in the listing (an early-return block waits too, and
    # sits before it); a layout putting it after the body fails here loudly, never silently
    waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    wait = waits[-1] if waits else -1
    launch = _first(lines, r"griddepcontrol\.launch_dependents")
    assert wait > 0 and 0 < launch < wait
    fn, consts, _ = KERNELS[IDS.index(name)]
    params = [a for a in fn.arg_names if a not in {**consts, "PDL": True}]
    forbidden = {params.index(a) for a in INTERMEDIATES if a in params}
    assert forbidden or name == "shrink"
    origin = _params_of(lines)
    early = [line for line in lines[:wait] if re.search(r"\bld\.global", line)]
    sources_of = [
        set().union(*(origin.get(r, set()) for r in REG.findall(line[line.index("[") :])))
        for line in early
    ]
    # no load before the wait has an address derived from a chain intermediate
    for line, sources in zip(early, sources_of):
        assert sources and not sources & forbidden, (line, sources)
    # and nothing is written, and nothing copied asynchronously, before it
    writes = [ln for ln in lines[:wait] if re.search(r"\b(st\.|atom\.|red\.|cp\.async)", ln)]
    assert not writes, writes
    # the up / down kernels load weight tiles before it (the point of the overlap)
    w = params.index("w_ptr") if "w_ptr" in params else -1
    assert any(w in sources for sources in sources_of) == early_weights


@pytest.mark.parametrize("name", IDS)
def test_pdl_off_leaves_no_pdl_instructions(ptx, name) -> None:
    lines = ptx[(name, False)]
    assert not [line for line in lines if "griddepcontrol" in line]


def _kernel_ast(module: str, kernel: str) -> ast.FunctionDef:
    fn = getattr(importlib.import_module(f"moelora.kernels.{module}"), kernel)
    return ast.parse(textwrap.dedent(inspect.getsource(getattr(fn, "fn", fn)))).body[0]


def _is_chain_point(st: ast.stmt) -> bool:
    return isinstance(st, ast.Expr) and ast.unparse(st.value) == "chain_point(PDL)"


ALIGNED = [
    ("align", "_align_kernel"),
    ("lora_shrink", "_lora_shrink_kernel"),
    ("lora_delta", "_lora_delta_kernel"),
    ("expert_up", "_expert_up_kernel"),
    ("expert_down", "_expert_down_kernel"),
    ("topk_reduce", "_topk_reduce_kernel"),
]


@pytest.mark.parametrize("module,kernel", ALIGNED, ids=[a[0] for a in ALIGNED])
def test_aligned_kernels_wait_before_anything(module, kernel) -> None:
    """The aligned path's kernels read nothing before the wait: the chain point is the
    first statement of the kernel body (PDL a constexpr parameter)."""
    func = _kernel_ast(module, kernel)
    assert "PDL" in [a.arg for a in func.args.args]
    body = [st for st in func.body if not isinstance(st, ast.Expr) or not isinstance(
        st.value, ast.Constant)]  # fmt: skip
    assert _is_chain_point(body[0])


def _returns_before_wait(body: list, waited: bool = False) -> list[int]:
    """Line numbers of `return`s reached without a chain_point call before them."""
    bad = []
    for st in body:
        if _is_chain_point(st):
            waited = True
        elif isinstance(st, ast.Return) and not waited:
            bad.append(st.lineno)
        for field in ("body", "orelse"):
            if isinstance(getattr(st, field, None), list) and not isinstance(st, ast.FunctionDef):
                bad += _returns_before_wait(getattr(st, field), waited)
    return bad


ALL_KERNELS = [
    *ALIGNED,
    ("decode_up", "_decode_up_kernel"),
    ("decode_down", "_decode_down_kernel"),
    ("decode_shrink", "_decode_shrink_kernel"),
]


@pytest.mark.parametrize("module,kernel", ALL_KERNELS, ids=[a[0] for a in ALL_KERNELS])
def test_every_exit_passes_the_chain_point(module, kernel) -> None:
    """A program that returns early still waits: otherwise a kernel whose programs all
    return (every pair another rank's) completes before the kernel before it, and what
    follows may overlap that kernel's writes."""
    func = _kernel_ast(module, kernel)
    assert not _returns_before_wait(func.body), f"{kernel}: return before chain_point"


def test_decode_chain_launch_modes(monkeypatch, seed) -> None:
    """With PDL active, the layer's first kernel is launched normally and every later one
    with PDL (the launchers' `chained`); under fully sharded LoRA no kernel uses PDL. The
    interpreter cannot run PDL, so the launchers are wrapped: the calls are recorded, then
    run with PDL off."""
    import dataclasses

    from moelora.activations import Activation
    from moelora.config import MoEShape
    from moelora.kernels import moe_lora
    from moelora.reference import moe_lora_reference
    from moelora.tiling.heuristic import DECODE_TILES
    from moelora.tiling.plan import plan_forward
    from moelora.weights import random_expert_weights, random_lora_bank

    calls = []

    def wrap(name):
        real = getattr(moe_lora, name)

        def launcher(*args, **kw):
            calls.append((name, kw.get("pdl"), kw.get("chained", False)))
            return real(*args, **{**kw, "pdl": False})

        monkeypatch.setattr(moe_lora, name, launcher)

    for name in ("decode_shrink", "decode_up", "decode_down"):
        wrap(name)
    g = torch.Generator().manual_seed(seed)
    shape = MoEShape(4, 2, 32, 16, Activation.SILU, dtype=torch.float32)
    experts = random_expert_weights(shape, generator=g)
    lora = random_lora_bank(shape, 2, 4, generator=g)
    x = torch.randn(3, 32, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(3)]).to(torch.int32)
    w = torch.rand(3, 2, generator=g)
    slots = torch.tensor([0, -1, 1], dtype=torch.int32)
    cfg = dataclasses.replace(DECODE_TILES, pdl=True)
    for bank in (lora, None):
        calls.clear()
        # the plan of a Hopper GPU (the interpreter itself could not run PDL)
        plan = plan_forward(
            cfg, lora=bank is not None, sharded=False, pdl_supported=True, interpreted=False
        )
        y = moe_lora.forward(plan, MoECall(x, ids, w, slots, bank), experts, shape)
        ref = moe_lora_reference(x, ids, w, slots, experts, bank, shape)
        assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4)
        if bank is not None:
            assert calls == [
                ("decode_shrink", True, False),  # first: launched normally
                ("decode_up", True, True),
                ("decode_down", True, True),
            ]
        else:
            assert calls == [("decode_up", True, False), ("decode_down", True, True)]


def test_pdl_never_active_on_cpu_or_in_the_interpreter() -> None:
    """The backend's plan on cpu (no GPU limits) and any plan in the interpreter: no PDL;
    the early weight loads still run interpreted (so the CPU tests cover them)."""
    import dataclasses

    from moelora.activations import Activation
    from moelora.backends.triton import forward_plan
    from moelora.config import MoEShape
    from moelora.tiling.heuristic import DECODE_TILES
    from moelora.tiling.plan import plan_forward
    from moelora.weights import random_expert_weights

    shape = MoEShape(4, 2, 32, 16, Activation.SILU, dtype=torch.float32)
    experts = random_expert_weights(shape)
    x, ids = torch.zeros(3, 32), torch.zeros(3, 2, dtype=torch.int32)
    for requested in (True, False):
        cfg = dataclasses.replace(DECODE_TILES, pdl=requested)
        assert not forward_plan(x, ids, experts, None, shape, config=cfg).pdl
        plan = plan_forward(cfg, lora=True, sharded=False, pdl_supported=True, interpreted=True)
        assert not plan.pdl and plan.early_loads == requested


if __name__ == "__main__":
    out = {
        json.dumps([name, on]): _compile(fn, {**consts, "PDL": on})
        for name, (fn, consts, _) in zip(IDS, KERNELS)
        for on in (False, True)
    }
    import moelora

    out["moelora"] = os.path.abspath(moelora.__file__)
    print(json.dumps(out))
