"""kernels/fp8_linear.py, the decode runner's block-scaled FP8 Linear (W8A8), against the
truth of transformers' FP8Linear (truth/w8a8.fp8_linear: its kernels' arithmetic in torch)
on transformers' own FP8Linear modules: fresh random weights quantized per block, rows and
widths off every tile and block edge, with and without bias."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.finegrained_fp8 import FP8Linear

from moelora.compare import assert_close
from moelora.engine.runner import fp8_block
from moelora.kernels.fp8_linear import fp8_linear, quantize_input
from moelora.truth import w8a8

# (id, rows T, outputs N, inputs K, block (bn, bk), bias): the edges each covers
CASES = [
    ("decode-row", 1, 40, 64, (32, 32), False),
    ("partial-group", 5, 96, 72, (32, 32), True),  # K = 2.25 groups: a partial last one
    ("rows-past-a-tile", 33, 130, 96, (64, 32), True),  # T > 16, N past BLOCK_N and a block
    ("wide-block", 7, 128, 256, (128, 128), False),  # the published checkpoints' block
]
DTYPES = [torch.float32, torch.float16]


def fp8_module(n: int, k: int, block, bias: bool, dtype, g: torch.Generator) -> FP8Linear:
    """transformers' FP8Linear holding a random weight quantized per [bn, bk] block (each
    block's amax to 448), its bias in `dtype`."""
    module = FP8Linear(k, n, block_size=block, has_bias=bias)
    w = torch.randn(n, k, generator=g) / k**0.5
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk)
    padded[:n, :k] = w
    scale = padded.reshape(nb, bn, kb, bk).abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    module.weight.data = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    module.weight_scale_inv.data = scale
    if bias:
        module.bias.data = torch.randn(n, generator=g).to(dtype)
    return module


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fp8_linear_equals_transformers_fp8linear_arithmetic(case, dtype, seed):
    _, rows, n, k, block, bias = case
    g = torch.Generator().manual_seed(seed)
    module = fp8_module(n, k, block, bias, dtype, g)
    assert fp8_block(module) == block
    x = torch.randn(rows, k, generator=g).to(dtype)
    x[0, : block[1]] *= 50.0  # one group far larger than the others: its own scale
    out = fp8_linear(quantize_input(x, block), module.weight, module.weight_scale_inv, block,
                     module.bias, dtype)  # fmt: skip
    ref = w8a8.fp8_linear(module, x)
    assert out.dtype == dtype and out.shape == (rows, n)
    assert_close(out, ref, dtype, what="y")
    # the activation quantization is part of what is checked: unquantized x is farther away
    bn, bk = block
    scale = module.weight_scale_inv.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    weight = module.weight.float() * scale[:n, :k]
    plain = x.float() @ weight.t() + (0 if module.bias is None else module.bias.float())
    assert (plain - ref.float()).abs().max() > (out.float() - ref.float()).abs().max()


def test_fp8_block_tells_the_formats_it_runs():
    g = torch.Generator().manual_seed(0)
    module = fp8_module(32, 32, (32, 32), False, torch.float32, g)
    assert fp8_block(module) == (32, 32)
    assert fp8_block(torch.nn.Linear(4, 4)) is None  # a plain Linear
    per_tensor = FP8Linear(32, 32, block_size=None)  # one scale: not a block format
    assert fp8_block(per_tensor) is None
    static = FP8Linear(32, 32, block_size=(32, 32), activation_scheme="static")
    assert fp8_block(static) is None
    # an activation group outside an FP8 dot's K step (32 to 256; Triton refuses a smaller
    # fp8 dot on the GPU, which the interpreter would run)
    for block in ((32, 16), (128, 512), (32, 48)):
        odd = fp8_module(64, 96, block, False, torch.float32, g)
        assert fp8_block(odd) is None, block


def test_attach_serves_fp8_linears_with_the_kernel_and_detach_gives_them_back(seed):
    """transformers' FP8Linear kernels come from the Hub (unreachable offline): while
    attached, each FP8Linear projection computes kernels/fp8_linear.py, equal to the truth's
    arithmetic on inputs of any leading shape; detach() gives the class's forward back."""
    from test_engine_runner_fp8 import _quantize_attention

    from moelora.hf import attach, toy

    model = toy.build_model("qwen3_moe", seed=seed % 1000)
    _quantize_attention(model, (32, 32))
    q = model.model.layers[0].self_attn.q_proj
    assert "forward" not in q.__dict__
    handle = attach(model, num_slots=1, max_rank=4, moe_backend="reference")
    x = torch.randn(2, 3, q.in_features, generator=torch.Generator().manual_seed(seed))
    out = q(x)
    assert out.shape == (2, 3, q.out_features)
    assert_close(out, w8a8.fp8_linear(q, x), torch.float32, what="q_proj")
    with w8a8.fp8_linears_as_truth(model):  # the truth's own forward inside, the kernel after
        assert q.forward.func is w8a8.fp8_linear
    assert_close(q(x), out, torch.float32, what="q_proj after the truth's context")
    handle.detach()
    assert "forward" not in q.__dict__
