"""--gpu-memory-utilization: the rows of KV cache a budget leaves room for (case table against
hand arithmetic), the measured bytes of one row against a bigger engine's own allocation and
against the attention shape, and the refusal on a CPU."""

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


@pytest.fixture(scope="module")
def handle():
    base = toy.build_model("qwen3_moe", seed=7)
    return attach(base, num_slots=1, max_rank=4, moe_backend="reference")


def test_measured_row_bytes_match_the_engines_allocation(handle):
    max_len = 24
    row_bytes, peak = kv_budget.measure(handle, max_len)
    engine = Engine(handle, max_rows=3, max_len=max_len)  # 3 rows + the spare
    assert engine.cache.nbytes() == 4 * row_bytes
    engine.close()
    c = handle.model.config  # K and V, per layer, fp32
    assert row_bytes == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * max_len * 4
    assert peak == 0  # a CPU: not measured


def test_a_cpu_is_refused_naming_the_flag(handle):
    with pytest.raises(ConfigError) as caught:
        kv_budget.engine_rows(handle, 24, 8, 0.9)
    assert "--gpu-memory-utilization" in str(caught.value) and "CPU" in str(caught.value)
