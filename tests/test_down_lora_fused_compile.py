"""The fused down + z-side LoRA launch (`fused_down_lora`) compiles for sm_90, without a GPU.

Run as a script with the interpreter off (tests/sm90_child.py), this file captures the
fused launch of a fused_moe_lora call (tests/sm90_launches.py: the launcher's constexprs,
signature and divisibility hints, the GEMM's num_warps / num_stages) for each variant,
compiles it for sm_90 as the JIT would, and prints the counts of Hopper MMA instructions
(wgmma, and the warp-level mma.sync of the LoRA tiles' 16-row dots) in its PTX and its
shared memory (or the compile error) as JSON; beside it the LoRA-free down GEMM of the same
config unfused, whose wgmma and shared memory the fused kernel must match.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from sm90_child import run_compile_child

from moelora.tiling.config import GemmTiles, TileConfig

# the Qwen3-30B-A3B +LoRA 64 x 16 rows' shape of config at T = 4096: BLOCK_M 128, the down
# GEMM 128 x 64 tiles at 8 warps, z sorted, the down side's delta into the reduce
BASE = TileConfig(128, GemmTiles(128, 64, 8, 4), GemmTiles(128, 64, 8, 4), z_sorted=True,
                  lora_delta=True, delta_in_reduce=True, shrink_expand=True)  # fmt: skip
RANK, SLOTS = 16, 8
# (id, knobs, dtype): each compiles; the fp32 one with exact dots (no MMA)
VARIANTS = [
    ("default", {}, "bf16"),
    ("down-tma-half-tail", dict(down_tma=True, half_tail=2), "bf16"),
    ("lora-stream", dict(lora_delta=False, delta_in_reduce=False, lora_stream=True), "bf16"),
    ("rank-128", dict(extra_rank=128), "bf16"),
    ("one-dot", dict(expand_one_dot=True), "bf16"),  # the LoRA tiles' expand as one dot
    ("fp32", {}, "fp32"),
]


def _compile(knobs: dict, dtype: str) -> dict:
    """The fused launch's MMA counts and shared bytes on sm_90, with the unfused
    down GEMM's MMA count (or the compile error)."""
    import torch
    from sm90_launches import compiled_launch, forward_launches

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    knobs = dict(knobs)
    rank = knobs.pop("extra_rank", RANK)
    got = {}
    for fused in (True, False):
        cfg = dataclasses.replace(BASE, **knobs, fused_down_lora=fused)
        launches = forward_launches(cfg, torch_dtype, rank, SLOTS)
        name = "_down_lora_fused_kernel" if fused else "_expert_down_kernel"
        fn, kwargs = next(launch for launch in launches if launch[0].__name__ == name)
        try:
            kernel = compiled_launch(fn, kwargs)
        except Exception as err:  # reported, the test fails with it
            return {"error": f"{name}: {type(err).__name__}: {str(err)[-600:]}"}
        key = "fused" if fused else "unfused"
        got[f"{key}_wgmma"] = kernel.asm["ptx"].count("wgmma.mma_async")
        got[f"{key}_mma_sync"] = kernel.asm["ptx"].count("mma.sync.aligned")
        got[f"{key}_shared"] = kernel.metadata.shared
        got[f"{key}_warps"] = kwargs["num_warps"]
    return got


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_compile_child(__file__)


@pytest.mark.parametrize(
    "key,dtype", [(v[0], v[2]) for v in VARIANTS], ids=[v[0] for v in VARIANTS]
)
def test_fused_launch_compiles_with_the_gemms_mma(compiled, key, dtype) -> None:
    got = compiled[key]
    assert "error" not in got, got["error"]
    assert got["fused_warps"] == got["unfused_warps"]  # the GEMM's launch options
    if dtype == "fp32":
        assert got["fused_wgmma"] == got["fused_mma_sync"] == 0  # exact fp32 dots: no MMA
    else:
        # the GEMM's wgmma all there; the LoRA tiles' 16-row dots (shrink, expand) add
        # warp-level MMA, which the unfused down GEMM has none of
        assert got["fused_wgmma"] == got["unfused_wgmma"] > 0, got
        assert got["fused_mma_sync"] > got["unfused_mma_sync"] == 0, got
    # the LoRA branch's buffers fit in the GEMM's shared memory (the fit of the down GEMM's
    # tiles, tiling/fit.py, holds for the fused launch)
    assert got["fused_shared"] == got["unfused_shared"], got


def test_one_dot_drops_the_lora_tiles_lo_dots(compiled) -> None:
    """expand_one_dot: the LoRA tiles' expand is one dot per N tile instead of the hi / lo
    pair, so the fused launch has fewer warp-level MMA; the GEMM's are unchanged."""
    one, default = compiled["one-dot"], compiled["default"]
    assert 0 < one["fused_mma_sync"] < default["fused_mma_sync"], (one, default)
    assert one["fused_wgmma"] == default["fused_wgmma"]


if __name__ == "__main__":
    import moelora

    out = {key: _compile(knobs, dtype) for key, knobs, dtype in VARIANTS}
    out["moelora"] = os.path.abspath(moelora.__file__)
    print(json.dumps(out))
