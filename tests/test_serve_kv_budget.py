"""--gpu-memory-utilization: the rows of KV cache a budget leaves room for, and on the decode
runner the blocks (case tables against hand arithmetic, refusals naming the flag and the
numbers); the probe engine's unit against a bigger engine's own allocation and against the
attention shape, for a slab cache (one row) and a paged one (one block); the refusal on a
CPU."""

from __future__ import annotations

import pytest

from moelora.engine import Engine
from moelora.errors import ConfigError
from moelora.hf import attach, toy
from moelora.serve import kv_budget

pytestmark = pytest.mark.filterwarnings("ignore")

GiB, MiB = 2**30, 2**20
CASES = [
    # (id, total, used, reserve, utilization, row_bytes, max_rows, rows): the edge covered
    ("capped-by-max-rows", 80 * GiB, 40 * GiB, GiB, 0.9, 10 * MiB, 64, 64),
    ("fits-some", 80 * GiB, 60 * GiB, GiB, 0.9, GiB, 64, (72 - 60 - 1) - 1),  # spare row
    ("exactly-two-rows", 10 * GiB, 7 * GiB, 0, 0.9, GiB, 64, 1),  # one row + the spare
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_rows_for_budget(case):
    _, total, used, reserve, util, row_bytes, max_rows, rows = case
    got = kv_budget.rows_for_budget(total=total, used=used, reserve=reserve,
                                    utilization=util, row_bytes=row_bytes, max_rows=max_rows)  # fmt: skip
    assert got == rows


def test_no_room_is_refused_naming_the_flag_and_the_numbers():
    with pytest.raises(ConfigError) as caught:
        kv_budget.rows_for_budget(total=80 * GiB, used=72 * GiB, reserve=0, utilization=0.9,
                                  row_bytes=GiB, max_rows=8)  # fmt: skip
    message = str(caught.value)
    assert "--gpu-memory-utilization" in message and "1024.0 MiB each" in message


BLOCKS = [
    # (id, total, used, reserve, utilization, block_bytes, max_len, block_size, blocks)
    ("fits-many", 80 * GiB, 40 * GiB, GiB, 0.9, MiB, 4096, 16, (72 - 40 - 1) * 1024),
    ("floor-of-a-part-block", 10 * GiB, 7 * GiB, 0, 0.9, 3 * MiB, 64, 16, 682),  # 2 GiB / 3 MiB
    ("exactly-one-request", 10 * GiB, 9 * GiB - 5 * MiB, 0, 0.9, MiB, 64, 16, 5),  # 4 + null
    ("max-len-not-a-multiple", 10 * GiB, 9 * GiB - 5 * MiB, 0, 0.9, MiB, 61, 16, 5),  # 61 -> 4
]


@pytest.mark.parametrize("case", BLOCKS, ids=[c[0] for c in BLOCKS])
def test_blocks_for_budget(case):
    _, total, used, reserve, util, block_bytes, max_len, size, blocks = case
    got = kv_budget.blocks_for_budget(
        total=total, used=used, reserve=reserve, utilization=util, block_bytes=block_bytes,
        max_len=max_len, block_size=size,
    )  # fmt: skip
    assert got == blocks


NO_BLOCKS = [
    # (id, used, reserve, max_len): the budget that does not hold one max_len request
    ("one-block-short", 9 * GiB - 4 * MiB, 0, 64),  # 4 blocks: the null block is missing
    ("activations-take-it", 8 * GiB, GiB, 64),  # nothing left after the prefill's peak
    ("weights-past-the-fraction", 9.5 * GiB, 0, 64),  # a negative budget
]


@pytest.mark.parametrize("case", NO_BLOCKS, ids=[c[0] for c in NO_BLOCKS])
def test_too_few_blocks_are_refused_naming_the_flag_the_need_and_the_fix(case):
    _, used, reserve, max_len = case
    with pytest.raises(ConfigError) as caught:
        kv_budget.blocks_for_budget(total=10 * GiB, used=int(used), reserve=reserve,
                                    utilization=0.9, block_bytes=MiB, max_len=max_len,
                                    block_size=16)  # fmt: skip
    message = str(caught.value)
    assert caught.value.key == "--gpu-memory-utilization" and caught.value.value == 0.9
    assert "at least 5 KV blocks" in message and "--max-model-len 64" in message
    assert "1.00 MiB each" in message and "raise --gpu-memory-utilization" in message


MIN_BLOCKS = [
    # (id, max_len, block_size, blocks): one request's blocks and the null block
    ("multiple", 64, 16, 5),
    ("one-past-a-multiple", 65, 16, 6),
    ("block-longer-than-max-len", 12, 16, 2),
    ("block-of-one", 7, 1, 8),
]


@pytest.mark.parametrize("case", MIN_BLOCKS, ids=[c[0] for c in MIN_BLOCKS])
def test_min_blocks(case):
    _, max_len, size, blocks = case
    assert kv_budget.min_blocks(max_len, size) == blocks


@pytest.fixture(scope="module")
def handle():
    base = toy.build_model("qwen3_moe", seed=7)
    return attach(base, num_slots=1, max_rank=4, moe_backend="reference")


def test_measured_row_bytes_match_the_engines_allocation(handle):
    max_len = 24
    probe = kv_budget.measure(handle, max_len)  # a CPU: transformers' forward, one slab a row
    assert not probe.paged
    engine = Engine(handle, max_rows=3, max_len=max_len)  # 3 rows + the spare
    assert engine.cache.nbytes() == 4 * probe.unit_bytes
    engine.close()
    c = handle.model.config  # K and V, per layer, fp32
    assert probe.unit_bytes == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * (
        max_len * 4)  # fmt: skip
    assert probe.peak == 0  # a CPU: not measured


def test_a_paged_probe_measures_one_block(handle):
    """The decode runner's probe: its cache paged, a block's bytes those of a 9-block
    engine's cache over 9, and the K / V arithmetic of the attention shape."""
    probe = kv_budget.measure(handle, 12, runner=True, block_size=4)
    assert probe.paged and probe.peak == 0
    engine = Engine(handle, max_rows=2, max_len=12, runner=True, block_size=4, num_blocks=9)
    assert engine.cache.nbytes() == 9 * probe.unit_bytes
    engine.close()
    c = handle.model.config
    assert probe.unit_bytes == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4 * 4


def test_a_cpu_is_refused_naming_the_flag(handle):
    with pytest.raises(ConfigError) as caught:
        kv_budget.engine_size(handle, 24, 8, 0.9)
    assert "--gpu-memory-utilization" in str(caught.value) and "CPU" in str(caught.value)
