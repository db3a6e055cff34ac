"""The aligned path's GEMM kernels compile for sm_90 in each knob variant, without a GPU.

The interpreter runs the kernels as Python, so a kernel that the Triton compiler rejects
(a constexpr rule, a shape that is not a compile-time constant) passes every
interpreted test and fails only on the GPU. This file, run as a script with the
interpreter off, compiles each variant for sm_90 and prints, per variant, the count of
Hopper MMA instructions (or the compile error) as JSON; the tests read that."""

from __future__ import annotations

import json
import os

import pytest
from sm90_child import run_compile_child

# (kernel, variant id) -> constexprs; the rest of each kernel's constexprs from BASE_*
BASE_UP = dict(GATED=True, ACT=0, HAS_BIAS=True, HAS_LORA=True, DELTA=False, WEIGHT_INPUT=False,
               Z_SORTED=True, EXPAND_FIRST=False, TAIL_VARIANTS=1, W_TMA=False, BLOCK_M=128,
               BLOCK_N=128,
               BLOCK_K=64, BLOCK_R=16, SLOTS_PER_DOT=2, GROUP_M=8, UPCAST=False, IEEE=False,
               PDL=False)  # fmt: skip
BASE_DOWN = dict(HAS_BIAS=True, HAS_LORA=True, DELTA=False, Z_SORTED=True, TMA=False,
                 MUL_WEIGHT=True, ATOMIC=False, EXPAND_FIRST=False, TAIL_VARIANTS=1, BLOCK_M=128,
                 BLOCK_N=256, BLOCK_K=64, BLOCK_R=16, SLOTS_PER_DOT=2, GROUP_M=8,
                 UPCAST=False, IEEE=False, PDL=False)  # fmt: skip
VARIANTS = {
    ("up", "default"): {},
    ("up", "half-tail"): dict(TAIL_VARIANTS=2),
    ("up", "half-tail-expand-first"): dict(TAIL_VARIANTS=2, EXPAND_FIRST=True),
    ("up", "half-tail-delta"): dict(TAIL_VARIANTS=2, DELTA=True),
    ("up", "half-tail-no-lora"): dict(TAIL_VARIANTS=2, HAS_LORA=False),
    ("up", "half-tail-tma"): dict(TAIL_VARIANTS=2, W_TMA=True),
    ("up", "tma-expand-first"): dict(W_TMA=True, EXPAND_FIRST=True),
    ("down", "default"): {},
    ("down", "half-tail"): dict(TAIL_VARIANTS=2),
    ("down", "half-tail-expand-first"): dict(TAIL_VARIANTS=2, EXPAND_FIRST=True),
    ("down", "half-tail-tma"): dict(TAIL_VARIANTS=2, TMA=True),
    ("down", "half-tail-tma-no-lora"): dict(TAIL_VARIANTS=2, TMA=True, HAS_LORA=False),
    ("down", "atomic-half-tail-tma"): dict(TAIL_VARIANTS=2, TMA=True, ATOMIC=True),
    ("down", "atomic-pointer-loads-expand-first"): dict(ATOMIC=True, EXPAND_FIRST=True),
    # other dtypes: fp16 MMA; fp32 with exact (IEEE) dots, which are not MMA instructions
    ("up", "fp16-half-tail-tma-expand-first"): dict(
        TAIL_VARIANTS=2, W_TMA=True, EXPAND_FIRST=True, _dtype="fp16"
    ),
    ("down", "fp16-half-tail-tma-expand-first"): dict(
        TAIL_VARIANTS=2, TMA=True, EXPAND_FIRST=True, _dtype="fp16"
    ),
    ("up", "fp32-half-tail-expand-first"): dict(
        TAIL_VARIANTS=2, EXPAND_FIRST=True, IEEE=True, _dtype="fp32"
    ),
    ("down", "fp32-half-tail-expand-first"): dict(
        TAIL_VARIANTS=2, EXPAND_FIRST=True, IEEE=True, _dtype="fp32"
    ),
}
BF16_PTRS = {"x_ptr", "w_ptr", "b_ptr", "z_ptr", "o_ptr", "lora_b_ptr", "delta_ptr"}
I32_PTRS = {"slots_ptr", "sorted_pair_ids_ptr", "block_experts_ptr", "num_padded_ptr"}


def _signature(fn, consts: dict, dtype: str) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name == "z_desc":
            sig[name] = f"tensordesc<{dtype}[{consts['BLOCK_M']}, {consts['BLOCK_K']}]>"
        elif name == "w_desc":
            sig[name] = f"tensordesc<{dtype}[1, {consts['BLOCK_N']}, {consts['BLOCK_K']}]>"
        elif name == "o_ptr" and consts.get("ATOMIC"):
            sig[name] = "*fp32"  # the top-k sum (atomic_reduce)
        elif name.endswith("_ptr"):
            sig[name] = (
                f"*{dtype}" if name in BF16_PTRS else "*i32" if name in I32_PTRS else "*fp32"
            )
        else:
            sig[name] = "fp32" if name in ("alpha", "limit") else "i32"
    return sig


def _compile_all() -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moelora.kernels.expert_down import _expert_down_kernel
    from moelora.kernels.expert_up import _expert_up_kernel

    kernels = {"up": (_expert_up_kernel, BASE_UP), "down": (_expert_down_kernel, BASE_DOWN)}
    result = {}
    for (name, variant), change in VARIANTS.items():
        fn, base = kernels[name]
        consts = {**base, **change}
        dtype = consts.pop("_dtype", "bf16")
        src = ASTSource(fn=fn, signature=_signature(fn, consts, dtype), constexprs=consts)
        try:
            kernel = triton.compile(
                src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 4}
            )
            ptx = kernel.asm["ptx"]
            result[f"{name}/{variant}"] = ptx.count("wgmma.mma_async")
            result[f"{name}/{variant}/red"] = ptx.count("red.global.gpu.relaxed.add.f32")
        except Exception as err:  # reported, the test fails with it
            result[f"{name}/{variant}"] = f"{type(err).__name__}: {str(err)[-600:]}"
    return result


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_compile_child(__file__)


@pytest.mark.parametrize("key", [f"{k}/{v}" for k, v in VARIANTS], ids=str)
def test_gemm_variant_compiles_to_hopper_mma(compiled, key) -> None:
    got = compiled[key]
    assert isinstance(got, int), got  # a compile error
    if "fp32" in key:
        assert got == 0  # exact fp32 dots: no tf32 MMA
    else:
        assert got > 0  # the dots became wgmma instructions


def test_atomic_reduce_compiles_to_fp32_reductions(compiled) -> None:
    """The atomic top-k sum is fire-and-forget fp32 reductions (red, not atom: no value
    comes back), and only in that variant."""
    assert compiled["down/atomic-half-tail-tma/red"] > 0
    assert compiled["down/atomic-pointer-loads-expand-first/red"] > 0
    assert compiled["down/half-tail-tma/red"] == 0


def test_half_tail_variant_adds_its_own_mma(compiled) -> None:
    """The half-height variant is a second compiled body (its own MMA), not folded away."""
    for name in ("up", "down"):
        assert compiled[f"{name}/half-tail"] > compiled[f"{name}/default"]


if __name__ == "__main__":
    import moelora

    out = _compile_all()
    out["moelora"] = os.path.abspath(moelora.__file__)
    print(json.dumps(out))
