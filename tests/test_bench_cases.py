"""`moelora bench`'s case registry: every id unique within its suite (results are keyed by
it), the suites before issue 19 unchanged, and the lora-sweep suite holding the issue's
configs; a bank a case cannot hold is refused naming the field."""

from __future__ import annotations

import pytest

from moelora.bench.cases import CASES, MIXED_RANKS, TOKENS, BenchCase
from moelora.errors import ConfigError

Q = "qwen3-30b-a3b"


@pytest.mark.parametrize("suite", sorted(CASES))
def test_case_ids_are_unique_in_every_suite(suite: str) -> None:
    ids = [c.id for c in CASES[suite]]
    assert len(ids) == len(set(ids))


def test_the_earlier_suites_keep_their_ids() -> None:
    # results recorded under these ids (benchmarks/results) stay comparable
    assert [c.id for c in CASES["qwen3"]] == [f"{Q}/T={t}/L=8/R=16" for t in TOKENS]
    assert all(c.slot_ranks == (16,) * 8 and c.max_rank == 16 for c in CASES["qwen3"])


# (id, case, its id): how a bank reads in the id
IDS = [
    ("uniform", BenchCase(Q, 4096, 64, 16), f"{Q}/T=4096/L=64/R=16"),
    ("padded", BenchCase(Q, 4096, 8, 8, bank_rank=128), f"{Q}/T=4096/L=8/R=128/ranks=8"),
    ("uniform-ranks-named", BenchCase(Q, 1, 2, 16, ranks=(16, 16)), f"{Q}/T=1/L=2/R=16"),
    ("mixed", BenchCase(Q, 16, 3, 64, ranks=(8, 64, 0)), f"{Q}/T=16/L=3/R=64/ranks=8,64,0"),
]


@pytest.mark.parametrize("case,want", [c[1:] for c in IDS], ids=[c[0] for c in IDS])
def test_the_id_names_the_bank(case: BenchCase, want: str) -> None:
    assert case.id == want


# the issue's configs: (adapters, bank R, each slot's real rank or None = R, T list)
SWEEP = [
    (8, 16, None, (1, 16, 64, 256, 1024, 4096, 16384)),
    (64, 16, None, (256, 4096, 16384)),
    (8, 128, None, (256, 4096, 16384)),
    (128, 16, None, (256, 4096)),
    (8, 256, None, (256, 4096)),
    (8, 128, (8,) * 8, (256, 4096, 16384)),  # rank-8 adapters padded to R = 128
    (8, 8, None, (256, 4096, 16384)),  # the same adapters in an R = 8 bank
    (8, 128, (8, 16, 64, 128, 8, 16, 64, 128), (4096, 16384)),  # the mixed bank
    (8, 64, None, (4096, 16384)),  # with 8x8 / 8x16 / 8x128: the rank-weighted mix
]


@pytest.mark.parametrize("adapters,rank,ranks,tokens", SWEEP)
def test_lora_sweep_holds_the_issue_configs(adapters, rank, ranks, tokens) -> None:
    have = {(c.adapters, c.max_rank, c.slot_ranks, c.tokens) for c in CASES["lora-sweep"]}
    for t in tokens:
        assert (adapters, rank, ranks or (rank,) * adapters, t) in have


def test_lora_sweep_is_the_qwen3_layer_only() -> None:
    assert {c.model for c in CASES["lora-sweep"]} == {Q}
    assert MIXED_RANKS == (8, 16, 64, 128, 8, 16, 64, 128)


# (id, bank arguments, the field the refusal names)
REFUSED = [
    ("ranks-length", dict(adapters=4, rank=16, ranks=(16, 8)), "'ranks'"),
    ("rank-above-bank", dict(adapters=2, rank=16, ranks=(16, 32)), "'ranks'"),
    ("bank-below-rank", dict(adapters=8, rank=16, bank_rank=8), "'rank'"),
]


@pytest.mark.parametrize("bank,field", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_a_bank_the_case_cannot_hold_is_refused(bank: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        BenchCase(Q, 16, **bank)
