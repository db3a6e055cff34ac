"""The tile table file (moelora/tiling/h200_table.json): the packaged table loads and
round-trips, and every malformed file or row is a TableError naming the file, the row
and the field."""

from __future__ import annotations

import copy
import json

import pytest

from moelora.errors import ConfigError
from moelora.tiling.pick import H200
from moelora.tiling.table import INF, TableError, load_table
from moelora.tiling.table_file import table_json

ROW = {
    "shape": {"experts": 128, "top_k": 8, "hidden": 2048, "intermediate": 768},
    "lora": True,
    "tokens": {"from": 1, "to": 64},
    "block_m": 32,
    "up": {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3},
    "down": {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3},
    "knobs": {"expand_lanes": 16, "z_sorted": True},
    "tuned": {"tokens": 16, "run": "abc1234", "before_ms": 0.3, "after_ms": 0.25},
}
SECOND = {**copy.deepcopy(ROW), "tokens": {"from": 65, "to": None}, "knobs": {}}
LABEL = "row 1 (experts=128 top_k=8 hidden=2048 intermediate=768, LoRA, T 65..inf)"


def _write(tmp_path, rows=None, **top) -> str:
    data = {"format": 1, "last_run": {}, "rows": [ROW, SECOND] if rows is None else rows}
    path = tmp_path / "table.json"
    path.write_text(json.dumps({**data, **top}))
    return str(path)


def test_the_packaged_table_loads_and_round_trips(tmp_path) -> None:
    assert len(H200.rows) > 40 and all(r.run for r in H200.rows)
    path = tmp_path / "again.json"
    path.write_text(table_json(H200.rows, H200.last_run))
    assert load_table(path) == H200
    # every shape and mode tiles T from 1 up to no bound
    for shape, lora in {(r.shape, r.lora) for r in H200.rows}:
        assert H200.lookup(shape, lora, 1) is not None and H200.lookup(shape, lora, INF)


def test_a_good_file_loads(tmp_path) -> None:
    table = load_table(_write(tmp_path))
    first, second = table.rows
    assert (first.max_tokens, second.max_tokens) == (64, INF)
    assert first.config().expand_lanes == 16 and first.config().z_sorted
    assert table.lookup((128, 8, 2048, 768), True, 65) is second
    assert first.describe() == "T=16: 0.3000 -> 0.2500 ms (abc1234 run)"


def _bad(**change) -> list:
    """[ROW with `change` applied (dotted keys reach inside), SECOND]."""
    row = copy.deepcopy(ROW)
    for dotted, value in change.items():
        *path, last = dotted.split("__")
        target = row
        for key in path:
            target = target[key]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value
    return [SECOND, row]  # the malformed one second: the error names row 1


# (id, change to the second row, what the message must name) — each a distinct defect
BAD_ROWS = [
    ("missing-tiles", dict(up=KeyError), "missing ['up']"),
    ("unknown-field", dict(knbos={}), "unknown ['knbos']"),
    ("unknown-knob", dict(knobs__expand_lane=16), "'expand_lane'"),
    ("lora-knob-on-lora-free", dict(lora=False, knobs__expand_lanes=16), "no LoRA knob"),
    ("knob-type", dict(knobs__z_sorted=1), "knobs.z_sorted"),
    ("half-tail", dict(knobs__half_tail=4), "knobs.half_tail"),
    ("not-pow2", dict(block_m=48), "block_m"),
    ("bool-as-int", dict(up__num_warps=True), "up.num_warps"),
    ("negative-stages", dict(down__num_stages=0), "down.num_stages"),
    ("shape-field", dict(shape__top_k="8"), "shape.top_k"),
    ("tuned-type", dict(tuned__before_ms="fast"), "tuned.before_ms"),
    ("decode-shrink", dict(knobs__decode_shrink=[1]), "knobs.decode_shrink"),
]


@pytest.mark.parametrize("change,names", [c[1:] for c in BAD_ROWS], ids=[c[0] for c in BAD_ROWS])
def test_a_malformed_row_names_the_row_and_field(tmp_path, change, names) -> None:
    path = _write(tmp_path, _bad(**change))
    with pytest.raises(TableError) as err:
        load_table(path)
    msg = str(err.value)
    assert path in msg and "row 1 (" in msg and names in msg, msg
    assert "Fix: re-run benchmarks/tune.py or fix that row" in msg
    assert isinstance(err.value, ConfigError)  # caught as any configuration error


def test_a_gap_or_overlap_between_rows_names_the_row(tmp_path) -> None:
    gap = {**copy.deepcopy(SECOND), "tokens": {"from": 70, "to": None}}
    with pytest.raises(TableError, match=r"row 1 .*T 70\.\.inf.*tokens\.from.*70.*expected 65"):
        load_table(_write(tmp_path, [ROW, gap]))
    first = {**copy.deepcopy(ROW), "tokens": {"from": 2, "to": 64}}  # T = 1 served by none
    with pytest.raises(TableError, match=r"row 0 .*expected 1"):
        load_table(_write(tmp_path, [first, SECOND]))
    inverted = {**copy.deepcopy(ROW), "tokens": {"from": 1, "to": 0}}
    with pytest.raises(TableError, match=r"row 0 .*tokens\.to"):
        load_table(_write(tmp_path, [inverted, SECOND]))


def test_an_unreadable_file_names_the_file(tmp_path) -> None:
    path = tmp_path / "table.json"
    path.write_text('{"format": 1, "rows": [')
    with pytest.raises(TableError, match=r"table\.json.*not JSON"):
        load_table(path)
    with pytest.raises(TableError, match=r"absent\.json.*unreadable"):
        load_table(tmp_path / "absent.json")
    with pytest.raises(TableError, match=r"format.*expected 1"):
        load_table(_write(tmp_path, format=2))
    with pytest.raises(TableError, match="rows"):
        load_table(_write(tmp_path, rows={"not": "a list"}))
