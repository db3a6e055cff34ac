"""The aligned path's GEMM kernels compile for sm_90 in each knob variant, without a GPU.

The interpreter runs the kernels as Python, so a kernel that the Triton compiler rejects
(a constexpr rule, a shape that is not a compile-time constant) passes every
interpreted test and fails only on the GPU. This file, run as a script with the
interpreter off, captures each variant's launch from a fused_moe_lora call and compiles it
for sm_90 as the JIT would at that launch (tests/sm90_launches.py: the launcher's
constexprs, signature and divisibility hints), and prints per variant the launch's
constexprs and the count of Hopper MMA instructions and fp32 reductions in its PTX (or
the compile error) as JSON; the tests read that."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import NamedTuple

import pytest
from sm90_child import run_compile_child

from moelora.tiling.config import GemmTiles, TileConfig

# the config every variant changes: the BLOCK_M 128 heuristic tiles, z in the sorted order
BASE = TileConfig(128, GemmTiles(128, 64, 8, 4), GemmTiles(256, 64, 8, 4), z_sorted=True)
RANK, SLOTS = 16, 8  # LoRA on: BLOCK_R 16, 2 slots per 32-lane expand dot, BLOCK_L 8
# the constexprs each kernel is launched with from BASE (with the expert biases)
BASE_UP = dict(GATED=True, ACT=0, HAS_BIAS=True, HAS_LORA=True, DELTA=False, WEIGHT_INPUT=False,
               Z_SORTED=True, EXPAND_FIRST=False, TAIL_VARIANTS=1, W_TMA=False, BLOCK_M=128,
               BLOCK_N=128,
               BLOCK_K=64, BLOCK_L=8, BLOCK_R=16, SLOTS_PER_DOT=2, GROUP_M=8, UPCAST=False, IEEE=False,
               PDL=False, W_FP8=False, SCALE_N=128, SCALE_K=128, ONE_DOT=False)  # fmt: skip
BASE_DOWN = dict(HAS_BIAS=True, HAS_LORA=True, DELTA=False, Z_SORTED=True, TMA=False,
                 MUL_WEIGHT=True, ATOMIC=False, EXPAND_FIRST=False, TAIL_VARIANTS=1, BLOCK_M=128,
                 BLOCK_N=256, BLOCK_K=64, BLOCK_L=8, BLOCK_R=16, SLOTS_PER_DOT=2, GROUP_M=8,
                 UPCAST=False, IEEE=False, PDL=False, W_FP8=False, SCALE_N=128,
                 SCALE_K=128, ONE_DOT=False)  # fmt: skip
KERNELS = {"up": ("_expert_up_kernel", BASE_UP), "down": ("_expert_down_kernel", BASE_DOWN)}


class Variant(NamedTuple):
    """One kernel's launch: BASE with `knobs` changed, which must launch it with `changes`
    to its BASE_* constexprs."""

    knobs: dict
    changes: dict
    dtype: str = "bf16"
    lora: bool = True
    fp8: str = ""  # e4m3 experts in this format (fp8_block: 128x128); "": the serving dtype


NO_LORA = dict(HAS_LORA=False, BLOCK_L=1, SLOTS_PER_DOT=1)  # one (unused) slot per dot
# BLOCK_K fitted to the 128x128 blocks' K side; the input quantized before (quant_rows.py);
# from BLOCK_M 64 the FP8 tiles (tiling/quantized.py: BLOCK_M 64, up BLOCK_N 64, down 128)
FP8_STEP = dict(W_FP8=True, BLOCK_K=128, BLOCK_M=64)
FP8_UP, FP8_DOWN = dict(BLOCK_N=64), dict(BLOCK_N=128)
# whole-row input scales, the FP8 tiles' BLOCK_K 128
FP8_CHANNEL = dict(FP8_STEP, SCALE_N=1, SCALE_K=128)
VARIANTS = {
    ("up", "default"): Variant({}, {}),
    ("up", "half-tail"): Variant(dict(half_tail=1), dict(TAIL_VARIANTS=2)),
    ("up", "half-tail-expand-first"): Variant(
        dict(half_tail=1, expand_first=True), dict(TAIL_VARIANTS=2, EXPAND_FIRST=True)
    ),
    ("up", "half-tail-delta"): Variant(
        dict(half_tail=1, lora_delta=True), dict(TAIL_VARIANTS=2, DELTA=True)
    ),
    ("up", "half-tail-no-lora"): Variant(
        dict(half_tail=1), dict(TAIL_VARIANTS=2, **NO_LORA), lora=False
    ),
    ("up", "half-tail-tma"): Variant(
        dict(half_tail=1, up_tma=True), dict(TAIL_VARIANTS=2, W_TMA=True)
    ),
    ("up", "tma-expand-first"): Variant(
        dict(up_tma=True, expand_first=True), dict(W_TMA=True, EXPAND_FIRST=True)
    ),
    ("down", "default"): Variant({}, {}),
    ("down", "half-tail"): Variant(dict(half_tail=2), dict(TAIL_VARIANTS=2)),
    ("down", "half-tail-expand-first"): Variant(
        dict(half_tail=2, expand_first=True), dict(TAIL_VARIANTS=2, EXPAND_FIRST=True)
    ),
    ("down", "half-tail-tma"): Variant(
        dict(half_tail=2, down_tma=True), dict(TAIL_VARIANTS=2, TMA=True)
    ),
    ("down", "half-tail-tma-no-lora"): Variant(
        dict(half_tail=2, down_tma=True), dict(TAIL_VARIANTS=2, TMA=True, **NO_LORA), lora=False
    ),
    ("down", "atomic-half-tail-tma"): Variant(
        dict(half_tail=2, down_tma=True, atomic_reduce=True),
        dict(TAIL_VARIANTS=2, TMA=True, ATOMIC=True),
    ),
    ("down", "atomic-pointer-loads-expand-first"): Variant(
        dict(atomic_reduce=True, expand_first=True), dict(ATOMIC=True, EXPAND_FIRST=True)
    ),
    # the LoRA expand as one 16-bit dot instead of the hi / lo pair (expand_one_dot)
    ("up", "one-dot"): Variant(dict(expand_one_dot=True), dict(ONE_DOT=True)),
    ("down", "one-dot"): Variant(dict(expand_one_dot=True), dict(ONE_DOT=True)),
    ("down", "one-dot-expand-first"): Variant(
        dict(expand_one_dot=True, expand_first=True), dict(ONE_DOT=True, EXPAND_FIRST=True)
    ),
    # other dtypes: fp16 MMA; fp32 with exact (IEEE) dots, which are not MMA instructions
    ("up", "fp16-half-tail-tma-expand-first"): Variant(
        dict(half_tail=1, up_tma=True, expand_first=True),
        dict(TAIL_VARIANTS=2, W_TMA=True, EXPAND_FIRST=True),
        dtype="fp16",
    ),
    ("down", "fp16-half-tail-tma-expand-first"): Variant(
        dict(half_tail=2, down_tma=True, expand_first=True),
        dict(TAIL_VARIANTS=2, TMA=True, EXPAND_FIRST=True),
        dtype="fp16",
    ),
    ("up", "fp32-half-tail-expand-first"): Variant(
        dict(half_tail=1, expand_first=True),
        dict(TAIL_VARIANTS=2, EXPAND_FIRST=True, IEEE=True),
        dtype="fp32",
    ),
    ("down", "fp32-half-tail-expand-first"): Variant(
        dict(half_tail=2, expand_first=True),
        dict(TAIL_VARIANTS=2, EXPAND_FIRST=True, IEEE=True),
        dtype="fp32",
    ),
    # block-scaled e4m3 experts (W8A8): a K step is one 128-column scale block, its input
    # rows quantized before the GEMM, multiplied on the FP8 tensor cores
    ("up", "fp8-block"): Variant({}, dict(FP8_STEP, **FP8_UP), fp8="fp8_block"),
    ("up", "fp8-block-half-tail-expand-first"): Variant(
        dict(half_tail=1, expand_first=True),
        dict(TAIL_VARIANTS=2, EXPAND_FIRST=True, **FP8_STEP, **FP8_UP),
        fp8="fp8_block",
    ),
    ("down", "fp8-block"): Variant({}, dict(FP8_STEP, **FP8_DOWN), fp8="fp8_block"),
    # per-channel e4m3 experts: each row's one activation scale, read at every step
    ("up", "fp8-channel"): Variant({}, dict(FP8_CHANNEL, **FP8_UP), fp8="fp8_channel"),
    ("down", "fp8-channel"): Variant({}, dict(FP8_CHANNEL, **FP8_DOWN), fp8="fp8_channel"),
    ("down", "fp8-block-atomic-no-lora"): Variant(
        dict(atomic_reduce=True),
        dict(ATOMIC=True, **FP8_STEP, **FP8_DOWN, **NO_LORA),
        lora=False,
        fp8="fp8_block",
    ),
}


# an fp32 reduction (no value back), of one value or a vector of 4 (group: ".v4" or "")
FP32_REDUCTION = re.compile(r"\bred\.global\.gpu\.relaxed\.add(\.v4)?\.f32\b")


def _compile(name: str, variant: Variant) -> dict:
    """The variant's launch: its constexprs, and the counts of wgmma instructions and fp32
    reductions (all, and the 4-wide ones) in its sm_90 PTX (or the compile error)."""
    import torch
    from sm90_launches import compiled_launch, forward_launches

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    cfg = dataclasses.replace(BASE, **variant.knobs)
    rank = RANK if variant.lora else 0
    launches = forward_launches(cfg, dtype[variant.dtype], rank, SLOTS, bias=True, fp8=variant.fp8)
    fn, kwargs = next(launch for launch in launches if launch[0].__name__ == KERNELS[name][0])
    constexprs = {p.name: kwargs.get(p.name, p.default) for p in fn.params if p.is_constexpr}
    got = {"constexprs": constexprs}
    try:
        ptx = compiled_launch(fn, kwargs).asm["ptx"]
    except Exception as err:  # reported, the test fails with it
        return {**got, "error": f"{type(err).__name__}: {str(err)[-600:]}"}
    reductions = FP32_REDUCTION.findall(ptx)
    got["wgmma"] = ptx.count("wgmma.mma_async")
    got["wgmma_e4m3"] = len(re.findall(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx))
    got["red"], got["red_v4"] = len(reductions), reductions.count(".v4")
    return got


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_compile_child(__file__)


KEYS = [f"{k}/{v}" for k, v in VARIANTS]


@pytest.mark.parametrize("key", KEYS, ids=str)
def test_gemm_variant_is_launched_as_named(compiled, key) -> None:
    """The launch compiled for each variant has the constexprs the variant is named for
    (its knobs were not dropped on the way, e.g. TMA falling back to pointer loads)."""
    name, variant = key.split("/", 1)
    expected = {**KERNELS[name][1], **VARIANTS[name, variant].changes}
    assert compiled[key]["constexprs"] == expected


@pytest.mark.parametrize("key", KEYS, ids=str)
def test_gemm_variant_compiles_to_hopper_mma(compiled, key) -> None:
    got = compiled[key]
    assert "error" not in got, got["error"]
    if "fp32" in key:
        assert got["wgmma"] == 0  # exact fp32 dots: no tf32 MMA
    else:
        assert got["wgmma"] > 0  # the dots became wgmma instructions


@pytest.mark.parametrize("key", KEYS, ids=str)
def test_fp8_variants_multiply_on_the_fp8_tensor_cores(compiled, key) -> None:
    """W8A8: the base GEMM's dots are e4m3 x e4m3 wgmma (the quantized rows times the e4m3
    weights), and only in the FP8 variants."""
    got = compiled[key]
    assert "error" not in got, got["error"]
    if "fp8" in key:
        assert got["wgmma_e4m3"] > 0
    else:
        assert got["wgmma_e4m3"] == 0


def test_atomic_reduce_compiles_to_fp32_reductions(compiled) -> None:
    """The atomic top-k sum is fire-and-forget fp32 reductions (red, not atom: no value
    comes back), and only in that variant."""
    assert compiled["down/atomic-half-tail-tma"]["red"] > 0
    assert compiled["down/atomic-pointer-loads-expand-first"]["red"] > 0
    assert compiled["down/half-tail-tma"]["red"] == 0


def test_atomic_reduce_adds_4_columns_per_reduction(compiled) -> None:
    """The launch's divisibility hints (o's address and row stride divisible by 16) let
    each reduction add 4 contiguous fp32 columns; compiled without them, the same kernel
    makes 4x the reductions, one value each."""
    for key in ("down/atomic-half-tail-tma", "down/atomic-pointer-loads-expand-first"):
        assert compiled[key]["red_v4"] == compiled[key]["red"], compiled[key]


def test_one_dot_expand_drops_the_lo_dots(compiled) -> None:
    """expand_one_dot: the expand's dots are half the hi / lo pair's, so the kernel has
    fewer MMA instructions than the default (the main K loop's are the same)."""
    for name in ("up", "down"):
        assert 0 < compiled[f"{name}/one-dot"]["wgmma"] < compiled[f"{name}/default"]["wgmma"]


def test_half_tail_variant_adds_its_own_mma(compiled) -> None:
    """The half-height variant is a second compiled body (its own MMA), not folded away."""
    for name in ("up", "down"):
        assert compiled[f"{name}/half-tail"]["wgmma"] > compiled[f"{name}/default"]["wgmma"]


if __name__ == "__main__":
    import moelora

    out = {f"{k}/{v}": _compile(k, variant) for (k, v), variant in VARIANTS.items()}
    out["moelora"] = os.path.abspath(moelora.__file__)
    print(json.dumps(out))
