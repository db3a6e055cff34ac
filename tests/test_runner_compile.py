"""The decode runner's kernels that read the paged KV cache or FP8 weights compile for sm_90
without a GPU (the interpreter runs what the GPU compiler refuses: an fp8 dot with K < 32
passed every interpreted test): decode attention (each split count, the combine, with and
without attention sinks), varlen prefill attention (query groups 4 and 8, sinks), DeepSeek's
latent attention (decode with and without splits, prefill), the rotary + cache write in
each family's form, the residual add + RMSNorm in both roundings, the FP8 Linear at each
row tile and the activation groups it serves, Qwen3.5's Gated DeltaNet step and its gated
norm, in the serving dtypes. Run as a script with
the interpreter off (tests/sm90_child.py); the tests read what it printed."""

from __future__ import annotations

import json
import os

import pytest
from sm90_child import run_compile_child

from moelora.kernels import prefill_attention

# the pointers' element types, by parameter name ("dt": the serving dtype of the case)
POINTERS = {
    "block_table_ptr": "*i32", "len_ptr": "*i64", "part_ptr": "*fp32", "stat_ptr": "*fp32",
    "block_seq_ptr": "*i32", "block_tok_ptr": "*i32", "starts_ptr": "*i32", "ends_ptr": "*i32",
    "rows_ptr": "*i64", "pos_ptr": "*i64", "pos0_ptr": "*i32", "q_ptr": "dt", "k_ptr": "dt",
    "v_ptr": "dt", "out_ptr": "dt", "qw_ptr": "dt", "kw_ptr": "dt", "cos_ptr": "dt",
    "sin_ptr": "dt", "q_out_ptr": "dt", "k_cache_ptr": "dt", "v_cache_ptr": "dt",
    "xs_ptr": "*fp32", "ws_ptr": "*fp32", "w_ptr": "*fp8e4nv", "bias_ptr": "dt", "sink_ptr": "dt",
    "x_ptr": "dt", "res_ptr": "dt", "y_ptr": "dt", "sum_ptr": "dt", "window_ptr": "dt",
    "b_ptr": "dt", "a_ptr": "dt", "a_log_ptr": "dt", "dt_bias_ptr": "dt", "state_ptr": "*fp32",
    "core_ptr": "*fp32", "z_ptr": "dt", "c_ptr": "dt", "q_scale_ptr": "*fp32",
}  # fmt: skip
# the FP8 Linear's q_ptr is its quantized input, not attention's queries
OVERRIDES = {
    "_fp8_linear_kernel": {"q_ptr": "*fp8e4nv"},
    "_add_rms_norm_kernel": {"w_ptr": "dt"},
    "_gated_delta_step_kernel": {"w_ptr": "dt"},
    "_gated_rms_norm_kernel": {"w_ptr": "dt"},
    "_mla_attention_kernel": {"rows_ptr": "*i32"},
}
FLOATS = {"scale", "eps"}
H200_SHARED = 232448  # max shared memory per block (opt-in) on an H200 / H100: 227 KB
DTYPES = {"bf16": "*bf16", "fp32": "*fp32", "fp16": "*fp16"}


def cases() -> dict[str, tuple[str, str, dict, int]]:
    """name -> (module, kernel, constexprs, num_warps), with the dtype in the name."""
    out = {}
    for dt in ("bf16", "fp32"):
        for splits, sinks in ((1, False), (4, False), (1, True), (4, True)):
            out[f"decode/{dt}/splits{splits}/sinks{sinks}"] = (
                "decode_attention", "_decode_attention_kernel",
                dict(SPLITS=splits, BLOCK_G=16, BLOCK_N=64, BLOCK_D=128, IEEE=dt == "fp32",
                     HAS_SINKS=sinks), 4,
            )  # fmt: skip
        for group, block_q, sinks in ((4, 32, False), (8, 16, False), (8, 16, True)):
            out[f"prefill/{dt}/group{group}/sinks{sinks}"] = (
                "prefill_attention", "_prefill_attention_kernel",
                dict(BLOCK_Q=block_q, BLOCK_G=group, BLOCK_N=64, BLOCK_D=128, IEEE=dt == "fp32",
                     HAS_SINKS=sinks), prefill_attention.WARPS,
            )  # fmt: skip
        for form, (norm, rounded, rope, scaled, values) in {
            "qwen3": (1, True, 1, False, True), "no-norm": (0, True, 1, False, True),
            "qwen3.5": (1, False, 1, False, True), "llama4": (2, True, 2, False, True),
            "nope-temperature": (0, True, 0, True, True),
            "deepseek-v3": (0, True, 3, False, False),
        }.items():  # fmt: skip
            out[f"rope_cache/{dt}/{form}"] = (
                "rope_cache", "_rope_cache_kernel",
                dict(NORM=norm, ROUND_NORMED=rounded, ROPE=rope, HAS_Q_SCALE=scaled,
                     HAS_V=values, BLOCK_D=128), 1,
            )  # fmt: skip
    for rounded in (True, False):  # gpt-oss's norm rounds once
        out[f"rms_norm/bf16/round_normed{rounded}"] = (
            "rms_norm", "_add_rms_norm_kernel",
            dict(HAS_RES=True, ROUND_NORMED=rounded, BLOCK_H=2048), 4,
        )  # fmt: skip
    for sinks in (False, True):
        out[f"combine/bf16/sinks{sinks}"] = (
            "decode_attention", "_combine_kernel", dict(SPLITS=4, BLOCK_D=128, HAS_SINKS=sinks), 1,
        )  # fmt: skip
    for dt in ("bf16", "fp32"):  # DeepSeek's latent attention: rank 512, rope 64
        mla = dict(BLOCK_N=32, BLOCK_R=512, BLOCK_P=64, IEEE=dt == "fp32")
        for splits in (1, 4):
            out[f"mla_decode/{dt}/splits{splits}"] = (
                "mla_attention", "_mla_attention_kernel",
                dict(DECODE=True, SPLITS=splits, BLOCK_Q=1, BLOCK_H=16, **mla), 8,
            )  # fmt: skip
        out[f"mla_prefill/{dt}"] = (
            "mla_attention", "_mla_attention_kernel",
            dict(DECODE=False, SPLITS=1, BLOCK_Q=16, BLOCK_H=2, **mla), 8,
        )  # fmt: skip
    for dt in ("bf16", "fp32"):  # Qwen3.5's linear attention: Dk = Dv = 128, conv width 4
        out[f"gated_delta_step/{dt}"] = (
            "gated_delta", "_gated_delta_step_kernel",
            dict(K=4, BLOCK_K=4, BLOCK_DK=128, BLOCK_V=32), 4,
        )  # fmt: skip
        out[f"gated_rms_norm/{dt}"] = ("gated_delta", "_gated_rms_norm_kernel", dict(BLOCK=128), 1)
    for dt in ("bf16", "fp16"):
        for rows in (16, 64):
            for bk in (32, 128):
                out[f"fp8_linear/{dt}/rows{rows}/group{bk}"] = (
                    "fp8_linear", "_fp8_linear_kernel",
                    dict(SCALE_N=128, HAS_BIAS=True, BLOCK_T=rows, BLOCK_N=64, BLOCK_K=bk), 4,
                )  # fmt: skip
    return out


CASES = cases()


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_compile_child(__file__, timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_runner_kernel_compiles_for_sm90(compiled, name) -> None:
    """It compiles, and its shared memory fits an H200's block (Triton refuses the launch
    otherwise, on the GPU only)."""
    got = compiled[name]
    assert "error" not in got, got["error"]
    assert got["ptx_lines"] > 0
    assert 0 <= got["shared"] <= H200_SHARED, got


def test_fp8_linear_dots_on_fp8_tensor_cores(compiled) -> None:
    """The FP8 Linear's dot runs on e4m3 operands (not widened to 16 bits first)."""
    for name in CASES:
        if name.startswith("fp8_linear/"):
            assert compiled[name].get("e4m3_dot"), (name, compiled[name])


def _compile(module: str, kernel: str, constexprs: dict, warps: int, dt: str) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(f"moelora.kernels.{module}"), kernel)

    def kind(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name in FLOATS:
            return "fp32"
        if name.endswith("_ptr"):
            ptr = OVERRIDES.get(kernel, {}).get(name, POINTERS[name])
            return DTYPES[dt] if ptr == "dt" else ptr
        return "i32"

    signature = {name: kind(name) for name in fn.arg_names}
    try:
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        done = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    except Exception as err:  # reported: the test fails with it
        return {"error": f"{type(err).__name__}: {str(err)[-600:]}"}
    ttgir = done.asm["ttgir"]
    dots = [line for line in ttgir.splitlines() if "dot" in line and "=" in line]
    return {
        "ptx_lines": done.asm["ptx"].count("\n"),
        "e4m3_dot": any("f8E4M3FN" in line for line in dots),
        "shared": done.metadata.shared,
    }


if __name__ == "__main__":
    import moelora

    result = {name: _compile(*case, name.split("/")[1]) for name, case in CASES.items()}
    result["moelora"] = os.path.abspath(moelora.__file__)
    print(json.dumps(result))
