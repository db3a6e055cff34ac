"""kernels/gated_delta.py through Triton's interpreter against the torch form of the same
decode step (moelora/engine/linear_attention.py, itself equal to transformers' Gated
DeltaNet: tests/test_linear_attention.py): core and the rows' states within the dtype's
tolerance, rows read through a permuted, sparse row list (other rows' states untouched),
widths that fill no block (Dk 24, Dv 40 over blocks of 32), one and two value heads per
key head, conv widths 4 and 3; then the gated norm alike. fp32 and fp16 (the interpreter's
bf16 is wrong)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moelora.compare import assert_close
from moelora.engine import linear_attention as la
from moelora.kernels.gated_delta import gated_delta_step, gated_rms_norm

DTYPES = [torch.float32, torch.float16]
# (id, key heads, value heads, Dk, Dv, conv width, rows)
CASES = [
    ("grouped-widths-off-block", 2, 4, 24, 40, 4, 3),
    ("one-per-key-head-k3", 3, 3, 16, 32, 3, 2),
]


def _mixer(hk, hv, dk, dv, width, dtype, g):
    """A stand-in Qwen3_5MoeGatedDeltaNet: the attributes linear_attention reads."""
    channels = 2 * hk * dk + hv * dv
    conv = torch.nn.Conv1d(channels, channels, width, groups=channels, bias=False)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * 0.5)
    norm = SimpleNamespace(weight=(1 + 0.3 * torch.randn(dv, generator=g)).to(dtype),
                           variance_epsilon=1e-6)  # fmt: skip
    return SimpleNamespace(
        conv1d=conv.to(dtype), activation="silu", num_k_heads=hk, num_v_heads=hv,
        head_k_dim=dk, head_v_dim=dv, key_dim=hk * dk, value_dim=hv * dv, conv_dim=channels,
        conv_kernel_size=width, A_log=torch.randn(hv, generator=g).to(dtype),
        dt_bias=torch.randn(hv, generator=g).to(dtype), norm=norm,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_step_kernel_equals_the_torch_step(case, dtype, seed):
    _, hk, hv, dk, dv, width, rows = case
    g = torch.Generator().manual_seed(seed)
    mixer = _mixer(hk, hv, dk, dv, width, dtype, g)
    states = 7
    state = la.LinearState(
        (torch.randn(states, mixer.conv_dim, width - 1, generator=g)).to(dtype),
        torch.randn(states, hv, dk, dv, generator=g) * 0.3,
    )
    at = torch.randperm(states, generator=g)[:rows]  # sparse, out of order
    qkv = torch.randn(rows, mixer.conv_dim, generator=g).to(dtype)
    b, a = (torch.randn(rows, hv, generator=g).to(dtype) for _ in range(2))
    mine, theirs = (la.LinearState(state.conv.clone(), state.recurrent.clone()) for _ in "ab")
    core = la._step(mixer, mine, at, qkv, b, a, fused=True)
    ref = la._step(mixer, theirs, at, qkv, b, a, fused=False)
    assert not core.isnan().any()
    assert_close(core, ref, dtype, what="core")
    assert_close(mine.recurrent, theirs.recurrent, dtype, what="states")
    assert torch.equal(mine.conv, theirs.conv)
    others = [r for r in range(states) if r not in at.tolist()]
    assert torch.equal(mine.recurrent[others], state.recurrent[others])
    assert not torch.equal(mine.recurrent[at], state.recurrent[at])  # the rows moved
    z = torch.randn(rows, hv * dv, generator=g).to(dtype)
    out = gated_rms_norm(core, z, mixer.norm.weight, mixer.norm.variance_epsilon)
    assert_close(out, la._output(mixer, core, z), dtype, what="gated norm")


def test_a_window_of_another_layout_is_refused():
    g = torch.Generator().manual_seed(0)
    mixer = _mixer(2, 4, 8, 8, 4, torch.float32, g)
    state = torch.zeros(3, 4, 8, 8)
    window = torch.zeros(2, mixer.conv_dim + 1, 4)
    with pytest.raises(ValueError, match="window"):
        gated_delta_step(window, mixer.conv1d.weight, torch.zeros(2, 4), torch.zeros(2, 4),
                         mixer.A_log, mixer.dt_bias, state, torch.tensor([0, 1]), 2)  # fmt: skip
