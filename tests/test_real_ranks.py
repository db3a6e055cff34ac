"""Each slot's real rank is data the triton kernels read (LoRABank.ranks), under
TRITON_INTERPRET=1 on CPU: slots of different ranks in one batch, rank 256, 128 slots, empty
slots (rank 0), and padded columns [r, R) holding large finite garbage that must not leak.

The truth is the reference on a clean copy of the bank (zeros past each slot's rank), so a
kernel that read the garbage, or a reference that did, fails.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moelora.activations import Activation
from moelora.backends.triton import fused_moe_lora
from moelora.call import MoECall
from moelora.compare import assert_close, poison_
from moelora.config import MoEShape
from moelora.errors import InputError
from moelora.reference import moe_lora_reference
from moelora.tiling.config import GemmTiles, TileConfig
from moelora.weights import LoRABank, random_expert_weights, random_lora_bank

TILES = TileConfig(16, GemmTiles(32, 32), GemmTiles(32, 32), shrink_block_k=32)
# large finite garbage (the kernels multiply a slot's columns [r, r rounded up to 16) by an
# exact zero intermediate, so the bank must be finite there: weights.LoRABank)
GARBAGE = {torch.float32: 1e30, torch.float16: 3e4}

# the pipeline's LoRA paths (docs/kernels.md): each must stop at every slot's real rank
PATHS = {
    "aligned": {},
    "aligned-narrow-dots": {"expand_lanes": 16},
    "expand-first": {"expand_first": True, "expand_lanes": 32},
    "split-k": {"shrink_split_k": 2},
    "delta": {"lora_delta": True},
    "lora-stream": {"lora_stream": True},
    "delta-in-reduce": {"lora_delta": True, "delta_in_reduce": True},
    "shrink-expand": {"lora_delta": True, "shrink_expand": True},
    "atomic-reduce": {"atomic_reduce": True},
    "decode": {"decode": True},
}


def _problem(seed, *, ranks, max_rank, tokens=12, experts=4, top_k=2, hidden=64, inter=32,
             act=Activation.SILU, dtype=torch.float32, slot_of=None):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    shape = MoEShape(experts, top_k, hidden, inter, act, dtype=dtype)
    experts_w = random_expert_weights(shape, generator=g)
    lora = random_lora_bank(shape, len(ranks), max_rank, ranks=list(ranks), generator=g)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = torch.topk(logits.softmax(-1), top_k)
    slot_of = slot_of or (lambda t: t % (len(ranks) + 1) - 1)  # every slot and -1
    slots = torch.tensor([slot_of(t) for t in range(tokens)], dtype=torch.int32)
    return shape, experts_w, lora, x, ids.to(torch.int32), weights, slots


def _with_garbage(lora: LoRABank) -> LoRABank:
    """A copy whose columns past each slot's real rank hold GARBAGE (the bank's ranks kept)."""
    value = GARBAGE[lora.w13_a.dtype]
    dirty = LoRABank(*(t.clone() for t in (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b)),
                     ranks=lora.ranks.clone(), tile_rank=lora.tile_rank)  # fmt: skip
    for slot, r in enumerate(lora.ranks.tolist()):
        dirty.w13_a[slot, :, :, r:] = value
        dirty.w13_b[slot, :, :, :, r:] = value
        dirty.w2_a[slot, :, r:] = value
        dirty.w2_b[slot, :, :, r:] = value
    return dirty


def _run(shape, experts, lora, x, ids, weights, slots, knobs):
    out = poison_(torch.empty_like(x))
    cfg = dataclasses.replace(TILES, **knobs)
    fused_moe_lora(MoECall(x, ids, weights, slots, lora, out=out), experts, shape, config=cfg)
    return out


@pytest.mark.parametrize("path", list(PATHS), ids=list(PATHS))
def test_mixed_ranks_with_garbage_padding(path: str, seed: int) -> None:
    """Ranks 8, 16, 40 and 64 in one R = 64 bank, one batch; the padding is 1e30."""
    problem = _problem(seed, ranks=(8, 64, 16, 40), max_rank=64)
    shape, experts, lora, x, ids, weights, slots = problem
    ref = moe_lora_reference(x, ids, weights, slots, experts, lora, shape)
    out = _run(shape, experts, _with_garbage(lora), x, ids, weights, slots, PATHS[path])
    assert_close(out, ref, what=f"mixed ranks, {path}")


def test_reference_ignores_columns_past_the_rank(seed: int) -> None:
    """The reference itself reads only [:r] of each slot (the kernels' truth)."""
    shape, experts, lora, x, ids, weights, slots = _problem(seed, ranks=(8, 32), max_rank=32)
    clean = moe_lora_reference(x, ids, weights, slots, experts, lora, shape)
    dirty = moe_lora_reference(x, ids, weights, slots, experts, _with_garbage(lora), shape)
    assert torch.equal(clean, dirty)
    base = moe_lora_reference(x, ids, weights, slots, experts, None, shape)
    assert not torch.allclose(clean, base)  # the adapters do change the output


@pytest.mark.parametrize("path", ["aligned", "delta", "decode"])
def test_rank_256(path: str, seed: int) -> None:
    """Rank 256 (several shrink rank chunks, expand dots across one slot's lanes), fp16."""
    problem = _problem(seed, ranks=(256, 24), max_rank=256, tokens=6, dtype=torch.float16)
    shape, experts, lora, x, ids, weights, slots = problem
    ref = moe_lora_reference(x, ids, weights, slots, experts, lora, shape)
    out = _run(shape, experts, _with_garbage(lora), x, ids, weights, slots, PATHS[path])
    assert_close(out, ref, what=f"rank 256, {path}")


@pytest.mark.parametrize("path", ["aligned", "expand-first", "decode"])
def test_128_slots(path: str, seed: int) -> None:
    """128 slots of ranks 8 and 16 with one token each (and a base row)."""
    ranks = tuple(8 if s % 3 else 16 for s in range(128))
    problem = _problem(seed, ranks=ranks, max_rank=16, tokens=130, experts=4, top_k=2,
                       hidden=32, slot_of=lambda t: t - 1 if t < 129 else 127)  # fmt: skip
    shape, experts, lora, x, ids, weights, slots = problem
    ref = moe_lora_reference(x, ids, weights, slots, experts, lora, shape)
    out = _run(shape, experts, _with_garbage(lora), x, ids, weights, slots, PATHS[path])
    assert_close(out, ref, what=f"128 slots, {path}")


@pytest.mark.parametrize("path", ["aligned", "expand-first", "delta", "decode"])
def test_empty_slots_cost_nothing_and_add_nothing(path: str, seed: int) -> None:
    """Rank-0 slots (the slot manager's empty slots) between used ones hold garbage in every
    column; rows that name them get the base output, the others their own adapters."""
    problem = _problem(seed, ranks=(16, 16, 8, 16), max_rank=16)
    shape, experts, lora, x, ids, weights, slots = problem
    lora.ranks[1] = 0
    lora.ranks[3] = 0
    ref = moe_lora_reference(x, ids, weights, slots, experts, lora, shape)
    clean_slots = torch.where((slots == 1) | (slots == 3), -1, slots)
    assert torch.equal(ref, moe_lora_reference(x, ids, weights, clean_slots, experts, lora, shape))
    out = _run(shape, experts, _with_garbage(lora), x, ids, weights, slots, PATHS[path])
    assert_close(out, ref, what=f"empty slots, {path}")


def test_tile_rank_is_performance_only(seed: int) -> None:
    """A tile rank below the ranks loaded (a plan keyed on an older state of the bank)
    changes the launch sizes, never the result."""
    problem = _problem(seed, ranks=(64, 8), max_rank=64)
    shape, experts, lora, x, ids, weights, slots = problem
    ref = moe_lora_reference(x, ids, weights, slots, experts, lora, shape)
    for tile_rank in (0, 8, 64):
        lora.tile_rank = tile_rank
        for path in ("aligned", "expand-first", "split-k"):
            out = _run(shape, experts, lora, x, ids, weights, slots, PATHS[path])
            assert_close(out, ref, what=f"tile_rank {tile_rank}, {path}")


def test_bank_rejects_bad_ranks() -> None:
    shape = MoEShape(2, 1, 16, 16, Activation.SILU)
    bank = LoRABank.empty(shape, 3, 8)
    assert bank.ranks.tolist() == [8, 8, 8] and bank.tile_rank == 8  # default: every slot at R
    factors = (bank.w13_a, bank.w13_b, bank.w2_a, bank.w2_b)
    with pytest.raises(InputError, match=r"LoRABank.ranks.*\[0, R = 8\]"):
        LoRABank(*factors, ranks=torch.tensor([1, 9, 2]))
    with pytest.raises(InputError, match=r"LoRABank.ranks.*\[L = 3\]"):
        LoRABank(*factors, ranks=torch.tensor([1, 2]))
    with pytest.raises(InputError, match="tile_rank"):
        LoRABank(*factors, tile_rank=9)


def test_slot_manager_writes_each_slots_rank(seed: int) -> None:
    """The manager's banks start empty (rank 0 everywhere, tile rank 0); a load writes the
    adapter's rank into its slot of every layer, an unload puts 0 back, and the tile rank
    follows the largest rank loaded."""
    from moelora.lora import Adapter, LayerLoRA, SlotManager
    from moelora.presets import resolve_model

    model = resolve_model("tiny")
    g = torch.Generator().manual_seed(seed)

    def adapter(name: str, rank: int) -> Adapter:
        layers = {}
        for layer in model.moe_layers:
            zeros = LayerLoRA.zeros(model.shape, rank)
            parts = (zeros.w13_a, zeros.w13_b, zeros.w2_a, zeros.w2_b)
            layers[layer] = LayerLoRA(*(torch.randn(t.shape, generator=g) for t in parts))
        return Adapter(name, "<memory>", rank, "per_expert", layers, model.shape)

    manager = SlotManager(model, 3, 16, dtype=torch.float32)
    banks = manager.snapshot().banks
    assert all(b.ranks.tolist() == [0, 0, 0] and b.tile_rank == 0 for b in banks.values())
    manager.load(adapter("a", 4))
    manager.load(adapter("b", 12))
    slot_a, slot_b = manager.loaded["a"], manager.loaded["b"]
    for bank in banks.values():
        assert bank.ranks[slot_a] == 4 and bank.ranks[slot_b] == 12 and bank.tile_rank == 12
    manager.unload("b")
    for bank in banks.values():
        assert bank.ranks[slot_b] == 0 and bank.ranks[slot_a] == 4 and bank.tile_rank == 4
