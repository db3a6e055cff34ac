"""The decode GEMVs on e4m3 rows (block and per-channel scales) compile for sm_90 without a GPU (the GEMM
kernels' FP8 variants: tests/test_gemm_compile.py). The interpreter converts e4m3 and
returns any type from a constexpr branch; the compiler is stricter, so a kernel that
passes every interpreted test can still fail on the GPU: this file, run as a script with
the interpreter off, compiles each with and without PDL and prints whether it did."""

from __future__ import annotations

import json
import os

import pytest
from sm90_child import run_compile_child

from moelora.kernels.launch_args import QuantRows

E4M3_PTRS = {"w_ptr", "xq_ptr"}  # the weights and the input quantized before
BF16_PTRS = {"x_ptr", "b_ptr", "z_ptr", "lora_b_ptr", "lora_a2_ptr", "y_ptr"}
I32_PTRS = {"topk_ids_ptr", "slots_ptr", "ranks_ptr"}
# the scale constexprs of each format (kernels/checks.py: fp8_scale_args)
FORMATS = {
    "block": dict(W_FP8=True, SCALE_N=128, SCALE_K=128, SCALE_COLUMNS=False),
    # the programs' rows share a scale block: the scales act on the input's columns
    "block_columns": dict(W_FP8=True, SCALE_N=128, SCALE_K=128, SCALE_COLUMNS=True),
    "channel": dict(W_FP8=True, SCALE_N=1, SCALE_K=128, SCALE_COLUMNS=False),
}
UP = dict(GATED=True, ACT=0, HAS_BIAS=True, HAS_LORA=True, WEIGHT_INPUT=False, BLOCK_N=16,
          BLOCK_K=128, BLOCK_R=16, EARLY=True)  # fmt: skip
DOWN = dict(HAS_BIAS=True, HAS_LORA=True, MUL_WEIGHT=True, ADD=False, BLOCK_J=8, BLOCK_N=16,
            BLOCK_K=128, BLOCK_R=16, EARLY=True)  # fmt: skip
CASES = ["up", "down"]
# the kernels' argument groups (Triton tuples, kernels/launch_args.py), by parameter name
GROUPS = {"x_quant": QuantRows, "z_quant": QuantRows}


def _signature(fn, constexprs: dict) -> dict:
    def kind(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if not name.endswith("_ptr"):
            return "fp32" if name in ("alpha", "limit") else "i32"
        if name in E4M3_PTRS:
            return "*fp8e4nv"
        return "*bf16" if name in BF16_PTRS else "*i32" if name in I32_PTRS else "*fp32"

    def group(name: str):  # a tuple argument: its fields' kinds, by the fields' own names
        fields = GROUPS[name]
        return fields(*(kind(f) for f in fields._fields))

    return {name: group(name) if name in GROUPS else kind(name) for name in fn.arg_names}


def _compile(fn, constexprs: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature=_signature(fn, constexprs), constexprs=constexprs)
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except Exception as err:  # reported, the test fails with it
        return {"error": f"{type(err).__name__}: {str(err)[-600:]}"}
    ptx = kernel.asm["ptx"]
    return {"cvt_e4m3": ptx.count("e4m3x2")}  # the e4m3 -> f16x2 conversions


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_compile_child(__file__, timeout=600)


KEYS = [f"{n}/{f}/{pdl}" for n in CASES for f in FORMATS for pdl in (False, True)]


@pytest.mark.parametrize("key", KEYS)
def test_decode_gemv_on_e4m3_rows_compiles_for_sm90(compiled, key) -> None:
    got = compiled[key]
    assert "error" not in got, got["error"]
    assert got["cvt_e4m3"] > 0  # the rows are read as e4m3 and converted in registers


if __name__ == "__main__":
    import moelora
    from moelora.kernels.decode_down import _decode_down_kernel
    from moelora.kernels.decode_up import _decode_up_kernel

    kernels = {"up": (_decode_up_kernel, UP), "down": (_decode_down_kernel, DOWN)}
    out = {
        f"{name}/{fmt}/{pdl}": _compile(fn, {**consts, **scales, "PDL": pdl})
        for name, (fn, consts) in kernels.items()
        for fmt, scales in FORMATS.items()
        for pdl in (False, True)
    }
    out["moelora"] = os.path.abspath(moelora.__file__)
    print(json.dumps(out))
