"""The floor's work count (moelora/bench/floors.py layer_work) against a hand count on a
tiny routing: each hit expert and each hit (slot, expert) pair read once, at its slot's
real rank; the FLOPs of every routed (token, k) with an adapter at its slot's rank."""

from __future__ import annotations

import pytest
import torch

from moelora.bench.floors import layer_work
from moelora.errors import ConfigError

H, INTER, PARTS, ELEM = 4, 2, 2, 2  # gated: w13 holds 2 parts
IDS = torch.tensor([[0, 1], [1, 2], [0, 1]])  # T = 3, K = 2: experts 0, 1, 2 hit
PER_EXPERT = (PARTS + 1) * H * INTER  # 24 elements
PER_RANK = PARTS * H + PARTS * INTER + INTER + H  # 18 elements of A and B per rank
BASE_BYTES = ELEM * (3 * PER_EXPERT + 2 * 3 * H)  # 3 experts, x read and y written
BASE_FLOPS = 2 * 3 * 2 * PER_EXPERT

# (id, token_slots, rank argument, rank-sum over hit pairs, rank-sum over routed entries)
CASES = [
    # pairs (0,0) (0,1) (1,1) (1,2); token 2 repeats token 0's pairs on slot 0
    ("per-slot", [0, 1, 0], [2, 5], 2 * 2 + 2 * 5, 4 * 2 + 2 * 5),
    # slot -1 adds no work: token 2's entries drop out of the FLOPs, not of the pairs
    ("per-slot-no-adapter", [0, 1, -1], [2, 5], 2 * 2 + 2 * 5, 2 * 2 + 2 * 5),
    ("scalar", [0, 1, 0], 3, 4 * 3, 6 * 3),  # the call before per-slot ranks
    ("rank-0-slot", [0, 1, 0], (0, 5), 2 * 5, 2 * 5),  # an empty slot reads nothing
]


@pytest.mark.parametrize(
    "slots,rank,pair_ranks,entry_ranks", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_lora_work_follows_each_slot_real_rank(slots, rank, pair_ranks, entry_ranks) -> None:
    out = layer_work(IDS, torch.tensor(slots), H, INTER, PARTS, rank, elem=ELEM)
    assert out.bytes == BASE_BYTES + ELEM * PER_RANK * pair_ranks
    assert out.flops == BASE_FLOPS + 2 * PER_RANK * entry_ranks


def test_uniform_ranks_equal_the_scalar_call() -> None:
    slots = torch.arange(64) % 8
    ids = torch.randint(0, 16, (64, 4))
    ref = layer_work(ids, slots, 64, 32, 2, 16)
    out = layer_work(ids, slots, 64, 32, 2, (16,) * 8)
    assert (out.bytes, out.flops) == (ref.bytes, ref.flops)


def test_without_lora_only_the_base_counts() -> None:
    out = layer_work(IDS, torch.tensor([0, 1, 0]), H, INTER, PARTS, [2, 5], elem=ELEM, lora=False)
    assert (out.bytes, out.flops) == (BASE_BYTES, BASE_FLOPS)


def test_too_few_ranks_are_refused() -> None:
    with pytest.raises(ConfigError, match="slot 1"):
        layer_work(IDS, torch.tensor([0, 1, 0]), H, INTER, PARTS, [2])
