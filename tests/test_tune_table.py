"""The tune's table writer: what it writes is what pick_config reads back, and rows it
does not re-tune keep their comments (which run chose them)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from benchmarks.table_buckets import Buckets
from benchmarks.tune import _row, committed_notes, with_kept_rows, write_table
from moelora.kernels import configs
from moelora.kernels.h200_table import H200_ROWS

HEADER = dict(device="GPU", torch="t", triton="tr", commit="abc1234", time="today", iters=20)

# a shape with two LoRA buckets: (.., 2048] measured at T = 1024, (2048, inf] at T = 4096
DIMS, INF = (8, 2, 4096, 14336), 2**31 - 1
OTHER = (64, 8, 2048, 1024, True, INF)  # another shape's row
TABLE = {
    (*DIMS, True, 2048): (128, (128, 64, 8, 4), (256, 64, 8, 4)),
    (*DIMS, True, INF): (128, (128, 64, 8, 3), (256, 64, 8, 3)),
    OTHER: (16, (64, 128, 4, 3), (64, 128, 4, 3)),
}
NOTES = {
    (*DIMS, True, 2048): "T=1024: 2.1 -> 1.6 ms (a run)",
    (*DIMS, True, INF): "T=4096: 7.0 -> 5.1 ms (b run)",
    OTHER: "T=64: 0.9 -> 0.8 ms (c run)",
}


def _load(path) -> dict:
    spec = importlib.util.spec_from_file_location("table", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.H200_ROWS


def test_table_round_trip_keeps_rows_and_notes(tmp_path) -> None:
    notes = committed_notes()
    assert set(notes) == set(H200_ROWS) and all(notes.values())
    key = next(k for k in H200_ROWS if k[4])  # re-tune one LoRA row, with the layout knobs
    cfg = dataclasses.replace(
        configs.H200_TABLE[key], expand_lanes=16, z_sorted=True, expand_first=True, half_tail=2
    )
    new_row = _row(cfg, True)
    entries = [(key, new_row, 64, 0.5, 0.4, "")]
    entries += [(k, r, 0, 0.0, 0.0, notes[k]) for k, r in H200_ROWS.items() if k != key]
    path = tmp_path / "h200_table.py"
    write_table(str(path), entries, HEADER)
    rows = _load(path)
    assert rows == {**H200_ROWS, key: new_row}
    back = committed_notes(str(path))
    assert back[key] == "T=64: 0.5000 -> 0.4000 ms (abc1234 run)"
    assert all(back[k] == notes[k] for k in H200_ROWS if k != key)
    assert configs._from_row(rows[key]).block_m == cfg.block_m
    assert configs._row_knobs(rows[key])["z_sorted"] is True
    # the knobs read back as written (what pick_config applies)
    knobs = configs._row_knobs(rows[key])
    assert knobs["expand_first"] is True and knobs["half_tail"] == 2


def test_tuning_another_shape_keeps_every_committed_row(tmp_path) -> None:
    """A tune of another model (OLMoE's shape here, not in the table) adds its rows; the
    committed rows of every other shape stay, with their notes (they were once dropped:
    only the tuned shape's rows were kept)."""
    notes = committed_notes()
    key = (64, 8, 2048, 1024, True, 64)
    assert not any(k[:4] == key[:4] for k in H200_ROWS)
    row = (32, (64, 128, 4, 3), (64, 128, 4, 3), {"expand_lanes": 16})
    path = tmp_path / "h200_table.py"
    write_table(str(path), with_kept_rows([(key, row, 64, 0.9, 0.8, "")], H200_ROWS, notes), HEADER)
    rows = _load(path)
    assert rows == {**H200_ROWS, key: row}
    back = committed_notes(str(path))
    assert all(back[k] == notes[k] for k in H200_ROWS)
    assert back[key] == "T=64: 0.9000 -> 0.8000 ms (abc1234 run)"


def test_tuning_another_t_splits_its_bucket_and_keeps_the_old_row() -> None:
    """A bucket whose row was measured at T = 4096 (running to infinity) and a tune at
    T = 16384: the new row takes (sqrt(4096 * 16384), inf], the old row (.., 8192] with its
    note. Tuning a smaller T splits the other way: the new row takes the lower part, the
    old keeps its key. Rows of other shapes are untouched."""
    b = Buckets(DIMS, TABLE, NOTES, [16384], "d41fbbb")
    assert b.key(16384, True) == (*DIMS, True, INF)
    moved = (*DIMS, True, 8192)
    assert b.table[moved] == TABLE[(*DIMS, True, INF)] and (*DIMS, True, INF) not in b.table
    assert b.notes[moved].startswith("T=4096: 7.0 -> 5.1 ms (b run); bucket split at T=8192")
    assert b.table[OTHER] == TABLE[OTHER]
    b2 = Buckets(DIMS, TABLE, NOTES, [3000], "e")
    assert b2.key(3000, True) == (*DIMS, True, 3505)  # isqrt(3000 * 4096)
    assert b2.table == TABLE
    # no committed row of this mode: bounds from the tuned T's neighbours
    b3 = Buckets(DIMS, TABLE, NOTES, [64, 1024], "f")
    assert b3.key(64, False) == (*DIMS, False, 256) and b3.key(1024, False) == (*DIMS, False, INF)


@pytest.mark.parametrize("order", [[4096, 16384], [16384, 4096]])
def test_keys_do_not_depend_on_the_tuning_order(order) -> None:
    """Re-tuning the committed row's own T and a larger one in one run, in either order:
    4096 keeps (2048, 8192], 16384 takes (8192, inf]; no two tuned T share a key (a shared
    key once dropped the second row), and the committed row, re-tuned, is not moved."""
    b = Buckets(DIMS, TABLE, NOTES, order, "g")
    assert b.key(4096, True) == (*DIMS, True, 8192)
    assert b.key(16384, True) == (*DIMS, True, INF)
    assert b.table == TABLE


def test_two_tuned_t_below_the_committed_row_share_its_bucket() -> None:
    """Bucket (2048, inf] measured at 16384; tuning 4096 and 6000: anchors 4096, 6000,
    16384, so 4096 -> (2048, 4957], 6000 -> (4957, 9914], and the committed row keeps
    (9914, inf] (its key and note unchanged)."""
    notes = {**NOTES, (*DIMS, True, INF): "T=16384: 9.0 -> 8.0 ms (h run)"}
    b = Buckets(DIMS, TABLE, notes, [6000, 4096], "i")
    assert b.key(4096, True) == (*DIMS, True, 4957)  # isqrt(4096 * 6000)
    assert b.key(6000, True) == (*DIMS, True, 9914)  # isqrt(6000 * 16384)
    assert b.table == TABLE and b.notes == notes
    keys = [b.key(t, True) for t in (4096, 6000)]
    assert len(set(keys)) == 2 and (*DIMS, True, INF) not in keys


def test_a_bucket_without_a_measured_t_is_split_between_the_tuned_t() -> None:
    """A committed row whose comment names no T: the tuned T inside its bucket share it,
    the largest taking the bucket's bound (replacing the row)."""
    notes = {**NOTES, (*DIMS, True, INF): "kept from the committed table"}
    b = Buckets(DIMS, TABLE, notes, [4096, 16384], "j")
    assert b.key(4096, True) == (*DIMS, True, 8192)
    assert b.key(16384, True) == (*DIMS, True, INF)
    assert b.table == TABLE
