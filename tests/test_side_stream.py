"""The lora_stream fork / join (kernels/side_stream.py) as the pipeline uses it.

On the GPU the branch runs on a second stream (checked there by `moelora validate --suite ranks`,
eager and graph replay). Here, on the CPU, the same pipeline code runs with a plan that has
lora_stream on (as a GPU forward's plan has it): the branch runs inline and must give the
reference's output, and a Branch must owe its join from the fork on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moelora.activations import Activation
from moelora.call import MoECall
from moelora.compare import assert_close
from moelora.config import MoEShape
from moelora.kernels import moe_lora
from moelora.kernels.side_stream import Branch, side_stream
from moelora.reference import moe_lora_reference
from moelora.tiling.config import GemmTiles, TileConfig
from moelora.tiling.plan import LoRAPath, plan_forward
from moelora.weights import random_expert_weights, random_lora_bank

TILES = TileConfig(16, GemmTiles(32, 32), GemmTiles(32, 32), shrink_block_k=32)


def _inputs(seed: int, tokens: int = 9, experts: int = 4, top_k: int = 2):
    """A tiny fp32 SiLU layer, 3 slots of ranks 16 / 8 / 16 and slot -1 among the tokens."""
    g = torch.Generator().manual_seed(seed)
    shape = MoEShape(experts, top_k, 48, 32, Activation.SILU, dtype=torch.float32)
    experts_w = random_expert_weights(shape, generator=g)
    lora = random_lora_bank(shape, 3, 16, ranks=[16, 8, 16], generator=g)
    x = torch.randn(tokens, 48, generator=g)
    weights, ids = torch.topk(torch.randn(tokens, experts, generator=g).softmax(-1), top_k)
    slots = torch.tensor([(2, -1, 0, 1)[t % 4] for t in range(tokens)], dtype=torch.int32)
    return shape, experts_w, lora, x, ids.to(torch.int32), weights, slots


@pytest.mark.parametrize("z_sorted", [False, True])
def test_the_pipeline_with_the_branch_forked_matches_the_reference(z_sorted, seed) -> None:
    shape, experts, lora, x, ids, weights, slots = _inputs(seed)
    cfg = dataclasses.replace(TILES, lora_stream=True, z_sorted=z_sorted)
    plan = plan_forward(cfg, lora=True, sharded=False, pdl_supported=False, interpreted=False)
    assert plan.lora_stream and plan.down_lora is LoRAPath.DELTA and not plan.down_gemm_lora
    got = moe_lora.forward(plan, MoECall(x, ids, weights, slots, lora), experts, shape)
    ref = moe_lora_reference(x, ids, weights, slots, experts, lora, shape)
    assert_close(got, ref, what="lora_stream branch inline")
    # the branch really is the down LoRA: without it the rows with an adapter differ
    base = moe_lora_reference(x, ids, weights, None, experts, None, shape)
    assert not torch.allclose(got[slots >= 0], base[slots >= 0], rtol=1e-3, atol=1e-3)


def test_a_branch_off_the_gpu_runs_inline_and_owes_no_join() -> None:
    calls = []
    with side_stream(torch.device("cpu")) as branch:
        branch.run(lambda: calls.append("ran") or (1, 2))
        assert calls == ["ran"] and branch.result == (1, 2) and branch.joined
        branch.join()  # nothing to wait for: a no-op


def test_a_branch_that_raises_is_still_joined(monkeypatch) -> None:
    """The join is owed from the fork on: an error inside the branch still leaves the
    caller's stream waiting for whatever the branch queued (stand-in streams here)."""
    waits = []

    class FakeStream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            waits.append((self.name, other.name))

    branch = Branch(torch.device("cpu"))
    branch.cuda, branch.main, branch.side = True, FakeStream("main"), FakeStream("side")
    monkeypatch.setattr(torch.cuda, "stream", lambda s: _Null())

    def boom():
        raise RuntimeError("kernel launch failed")

    with pytest.raises(RuntimeError):
        branch.run(boom)
    assert not branch.joined
    branch.join()
    branch.join()  # once only
    assert waits == [("side", "main"), ("main", "side")]


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
