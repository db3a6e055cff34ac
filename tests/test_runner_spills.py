"""The decode runner's kernels launched as the JIT launches them at serving shapes (the
launch's own arguments specialise divisibility and constants: tests/sm90_launches.py),
compiled for sm_90 and assembled by Triton's ptxas: no register spills, shared memory
within an H200 block. A spill sits in a kernel's inner loop (the prefill attention's
[128, 128] fp32 accumulator at 4 warps spilled 260 bytes a thread). Shapes: Qwen3-30B-A3B's
(hidden 2048, 32 query heads over 4 KV heads of 128, 128 experts top 8, vocabulary 151936,
LoRA rank 16 over 8 slots), gpt-oss's attention (64 over 8 of 64, sinks), DeepSeek-V3's
latent (128 heads over a 512 + 64 latent), Qwen3.5-35B-A3B's Gated DeltaNet (16 key heads,
32 value heads of 128), an FP8 checkpoint's q / k / v (128 x 128 blocks); 1 and 64 rows.
Run as a script with the interpreter off (tests/sm90_child.py), it prints each case's
numbers as JSON."""

from __future__ import annotations

import json
import os
import re

import pytest
from sm90_child import run_compile_child

H200_SHARED = 232448  # max shared memory per block (opt-in) on an H200 / H100: 227 KB
CASES = ("prefill/qwen3", "prefill/gpt-oss-sinks", "decode/qwen3-b64", "decode/qwen3-b1",
         "decode/gpt-oss-sinks", "mla_prefill/deepseek-v3", "mla_decode/deepseek-v3-b64",
         "qkv_lora/qwen3-b1", "qkv_lora/qwen3-b64", "lm_head_lora/qwen3-b64", "rope_cache/qwen3",
         "rope_cache/qwen3.5", "rope_cache/llama4", "rope_cache/deepseek-v3",
         "rms_norm/qwen3", "router_topk/qwen3", "fp8_qkv/qwen3-b64", "gated_delta/qwen3.5-b64")  # fmt: skip


def _other(kind: str, model: str, rows: int, bf) -> None:
    """The case's launcher on empty CPU tensors, beside attention (inside _recorded)."""
    import torch

    from moelora.kernels import dense_linear, dense_lora, fp8_linear, gated_delta, rms_norm
    from moelora.kernels.rope_cache import rope_and_cache
    from moelora.kernels.router_topk import router_topk

    x = torch.empty(rows, 2048, dtype=bf)
    slots = torch.zeros(rows, dtype=torch.int32)
    if kind == "qkv_lora":
        banks = [torch.empty(8, 16, 2048, dtype=bf) for _ in range(3)]
        z = dense_linear.lora_shrink(x, slots, banks)
        weights = [torch.empty(m, 2048, dtype=bf) for m in (4096, 512, 512)]
        bt = [torch.empty(8, 16, m, dtype=bf) for m in (4096, 512, 512)]
        dense_linear.dense_linear(x, weights, [None] * 3, slots, z, bt)
    elif kind == "lm_head_lora":
        out = torch.empty(rows, 151936, dtype=bf)
        a, bt = torch.empty(8, 16, 2048, dtype=bf), torch.empty(8, 16, 151936, dtype=bf)
        dense_lora.add_dense_lora(out, x, slots, a, bt)
    elif kind == "rope_cache":  # Qwen3.5: 16 q heads of 256 (with their gates), 64 rotated
        heads, width = (16, 256) if model == "qwen3.5" else (32, 128)
        q = torch.empty(rows, heads * width * (2 if model == "qwen3.5" else 1), dtype=bf)
        kv = torch.empty(rows, 4 * width, dtype=bf)
        cache = torch.empty(64, 4, 16, width, dtype=bf)
        where = torch.zeros(rows, dtype=torch.long)
        if model == "deepseek":  # 128 heads' rotary parts (nope 128, rope 64), no values
            q, ckv = torch.empty(rows, 128 * 192, dtype=bf), torch.empty(rows, 576, dtype=bf)
            cos, latents = torch.empty(rows, 64, dtype=bf), torch.empty(64, 1, 16, 576, dtype=bf)
            rope_and_cache(q[:, 128:], ckv[:, 512:], None, cos, cos, latents[..., 512:], None,
                           where, where, rope="deinterleaved", head_dim=64, q_head_stride=192,
                           q_heads=128)  # fmt: skip
        elif model == "llama4":  # complex pairs in fp32, the weightless norm after
            cos = torch.empty(rows, width // 2)
            rope_and_cache(q, kv, kv, cos, cos, cache, cache, where, where, norm="after",
                           rope="pairs", head_dim=width)  # fmt: skip
        elif model == "qwen3.5":
            cos, norm = torch.empty(rows, 64, dtype=bf), torch.empty(width)
            rope_and_cache(q, kv, kv, cos, cos, cache, cache, where, where, norm, norm,
                           round_normed=False, head_dim=width, q_head_stride=2 * width)  # fmt: skip
        else:
            cos, norm = torch.empty(rows, width, dtype=bf), torch.empty(width, dtype=bf)
            rope_and_cache(q, kv, kv, cos, cos, cache, cache, where, where, norm, norm)
    elif kind == "rms_norm":
        rms_norm.add_rms_norm(x, x, torch.empty(2048, dtype=bf), 1e-6)
    elif kind == "router_topk":
        router_topk(torch.empty(rows, 128, dtype=bf), 8, True)
    elif kind == "fp8_qkv":
        quantized = fp8_linear.quantize_input(x, (128, 128))
        for m in (4096, 512, 512):
            w = torch.empty(m, 2048, dtype=torch.float8_e4m3fn)
            fp8_linear.fp8_linear(quantized, w, torch.empty(m // 128, 16), (128, 128), None, bf)
    elif kind == "gated_delta":  # conv width 4; channels 2 x 16 x 128 + 32 x 128
        channels = 2 * 16 * 128 + 32 * 128
        state = torch.empty(rows, 32, 128, 128)
        core = gated_delta.gated_delta_step(
            torch.empty(rows, channels, 4, dtype=bf), torch.empty(channels, 1, 4, dtype=bf),
            torch.empty(rows, 32, dtype=bf), torch.empty(rows, 32, dtype=bf),
            torch.empty(32, dtype=bf), torch.empty(32, dtype=bf), state,
            torch.arange(rows), 16)  # fmt: skip
        gated_delta.gated_rms_norm(core, torch.empty(rows, 32 * 128, dtype=bf),
                                   torch.empty(128, dtype=bf), 1e-6)  # fmt: skip
    else:
        raise KeyError(kind)


def _launch(case: str) -> list[tuple]:
    """[(kernel, kwargs)] that the case's launcher makes on empty CPU tensors (recorded,
    nothing runs)."""
    import torch
    from sm90_launches import _recorded

    from moelora.kernels.decode_attention import decode_attention
    from moelora.kernels.mla_attention import mla_decode_attention, mla_prefill_attention
    from moelora.kernels.prefill_attention import prefill_attention, varlen_table

    bf, kind, model = torch.bfloat16, *case.split("/")
    rows = 1 if model.endswith("-b1") else 64
    table = torch.zeros(rows, 64, dtype=torch.int32)
    lengths = torch.ones(rows, dtype=torch.int64)
    with _recorded() as calls:
        if kind not in ("prefill", "decode", "mla_prefill", "mla_decode"):
            _other(kind, model.split("-")[0], rows, bf)
        elif kind.startswith("mla"):
            cache = torch.empty(64, 1, 16, 576, dtype=bf)
            if kind == "mla_prefill":
                q = torch.empty(512, 128, 576, dtype=bf)
                spans = varlen_table([512], [0], [0], 128, "cpu")
                mla_prefill_attention(q, cache, spans, table, 0.1, 512)
            else:
                q = torch.empty(rows, 128, 576, dtype=bf)
                mla_decode_attention(q, cache, table, lengths, 0.1, 512, 1024)
        else:
            hq, hk, d = (64, 8, 64) if model.startswith("gpt-oss") else (32, 4, 128)
            sinks = torch.empty(hq, dtype=bf) if "sinks" in model else None
            keys, values = (torch.empty(64, hk, 16, d, dtype=bf) for _ in range(2))
            if kind == "prefill":
                q = torch.empty(512, hq, d, dtype=bf)
                spans = varlen_table([512], [0], [0], hq // hk, "cpu")
                prefill_attention(q, keys, values, spans, table, 0.1, 128, sinks)
            else:
                q = torch.empty(rows, hq, d, dtype=bf)
                decode_attention(q, keys, values, table, lengths, 0.1, 1024, 128, sinks)
    return [(fn, kw) for fn, kw in calls if fn.__name__ != "_combine_kernel"]


def _assembled(fn, kwargs: dict) -> dict:
    """Shared memory, registers and spill bytes of `fn` compiled for sm_90 at this launch."""
    import subprocess
    import tempfile

    import triton
    from sm90_launches import SM90, launch_source
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    src, options = launch_source(fn, kwargs)
    done = triton.compile(src, target=GPUTarget(*SM90), options=options.__dict__)
    try:
        ptxas = get_ptxas(SM90[1]).path
    except TypeError:  # (Triton < 3.5: no arch argument)
        ptxas = get_ptxas().path
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(done.asm["ptx"])
        out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", ptx + ".cubin"],
                             capture_output=True, text=True, check=True).stderr  # fmt: skip
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", out)]
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", out)]
    return {"kernel": fn.__name__, "warps": options.num_warps, "shared": done.metadata.shared,
            "spill_bytes": sum(spills), "registers": max(registers)}  # fmt: skip


@pytest.fixture(scope="module")
def assembled() -> dict:
    return run_compile_child(__file__, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_runner_kernel_neither_spills_nor_overflows_shared_memory(assembled, case):
    for got in assembled[case]:
        assert "error" not in got, got["error"]
        assert got["registers"] > 0, got  # ptxas reported on this kernel
        assert got["spill_bytes"] == 0, got
        assert 0 <= got["shared"] <= H200_SHARED, got


if __name__ == "__main__":
    import moelora

    result = {}
    for case in CASES:
        try:
            result[case] = [_assembled(fn, kw) for fn, kw in _launch(case)]
        except Exception as err:  # reported: the test fails with it
            result[case] = [{"error": f"{type(err).__name__}: {str(err)[-600:]}"}]
    result["moelora"] = os.path.abspath(moelora.__file__)
    print(json.dumps(result))
