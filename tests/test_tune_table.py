"""The tune's table writer: what it writes is what pick_config reads back, and rows it
does not re-tune keep their record (which run chose them, their times and notes)."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.table_buckets import Buckets
from benchmarks.tune import table_row, with_kept_rows
from moelora.tiling.config import GemmTiles, TileConfig
from moelora.tiling.pick import H200
from moelora.tiling.table import TableRow, load_table
from moelora.tiling.table_file import write_table

HEADER = dict(device="GPU", torch="t", triton="tr", commit="abc1234", time="today", iters=20)

# a shape with two LoRA buckets: (.., 2048] measured at T = 1024, (2048, inf] at T = 4096
DIMS, INF = (8, 2, 4096, 14336), 2**31 - 1
OTHER = (64, 8, 2048, 1024, True, INF)  # another shape's row


def _row(key, block_m, up, down, t, before, after, run, note=""):
    return TableRow(
        key[:4],
        key[4],
        key[5],
        block_m,
        GemmTiles(*up),
        GemmTiles(*down),
        tuned_at=t,
        run=run,
        before_ms=before,
        after_ms=after,
        note=note,
    )


TABLE = {
    (*DIMS, True, 2048): _row(
        (*DIMS, True, 2048), 128, (128, 64, 8, 4), (256, 64, 8, 4), 1024, 2.1, 1.6, "a"
    ),
    (*DIMS, True, INF): _row(
        (*DIMS, True, INF), 128, (128, 64, 8, 3), (256, 64, 8, 3), 4096, 7.0, 5.1, "b"
    ),
    OTHER: _row(OTHER, 16, (64, 128, 4, 3), (64, 128, 4, 3), 64, 0.9, 0.8, "c"),
}


def test_table_round_trip_keeps_rows_and_notes(tmp_path) -> None:
    committed = H200.by_key()
    assert all(r.describe() for r in committed.values())  # every row says which run chose it
    key = next(k for k in committed if k[4])  # re-tune one LoRA row, with the layout knobs
    tiles = TileConfig(committed[key].block_m, committed[key].up, committed[key].down)
    cfg = dataclasses.replace(tiles, expand_lanes=16, z_sorted=True, expand_first=True, half_tail=2)
    new_row = table_row(cfg, True, key, 64, 0.5, 0.4, HEADER["commit"])
    rows = [new_row] + [r for k, r in committed.items() if k != key]
    path = tmp_path / "h200_table.json"
    write_table(path, rows, HEADER)
    back = load_table(path).by_key()
    assert back == {**committed, key: new_row}
    assert back[key].describe() == "T=64: 0.5000 -> 0.4000 ms (abc1234 run)"
    assert all(back[k].describe() == committed[k].describe() for k in committed if k != key)
    assert back[key].config().block_m == cfg.block_m
    # the knobs read back as written (what pick_config applies)
    knobs = back[key].knobs
    assert knobs["z_sorted"] is True and knobs["expand_first"] is True and knobs["half_tail"] == 2


def test_tuning_another_shape_keeps_every_committed_row(tmp_path) -> None:
    """A tune of another model (OLMoE's shape here, not in the table) adds its rows; the
    committed rows of every other shape stay, with their records (they were once dropped:
    only the tuned shape's rows were kept)."""
    committed = H200.by_key()
    key = (64, 8, 2048, 1024, True, 64)
    assert not any(k[:4] == key[:4] for k in committed)
    cfg = TileConfig(32, GemmTiles(64, 128, 4, 3), GemmTiles(64, 128, 4, 3), expand_lanes=16)
    row = table_row(cfg, True, key, 64, 0.9, 0.8, HEADER["commit"])
    path = tmp_path / "h200_table.json"
    write_table(path, with_kept_rows([row], committed), HEADER)
    back = load_table(path).by_key()
    assert back == {**committed, key: row}
    assert back[key].describe() == "T=64: 0.9000 -> 0.8000 ms (abc1234 run)"


def test_tuning_another_t_splits_its_bucket_and_keeps_the_old_row() -> None:
    """A bucket whose row was measured at T = 4096 (running to infinity) and a tune at
    T = 16384: the new row takes (sqrt(4096 * 16384), inf], the old row (.., 8192] with its
    record. Tuning a smaller T splits the other way: the new row takes the lower part, the
    old keeps its key. Rows of other shapes are untouched."""
    b = Buckets(DIMS, TABLE, [16384], "d41fbbb")
    assert b.key(16384, True) == (*DIMS, True, INF)
    moved = (*DIMS, True, 8192)
    old = TABLE[(*DIMS, True, INF)]
    assert b.table[moved] == dataclasses.replace(
        old, max_tokens=8192, note="bucket split at T=8192 by the d41fbbb run"
    )
    assert (*DIMS, True, INF) not in b.table
    assert (
        b.table[moved]
        .describe()
        .startswith("T=4096: 7.0000 -> 5.1000 ms (b run); bucket split at T=8192")
    )
    assert b.table[OTHER] == TABLE[OTHER]
    b2 = Buckets(DIMS, TABLE, [3000], "e")
    assert b2.key(3000, True) == (*DIMS, True, 3505)  # isqrt(3000 * 4096)
    assert b2.table == TABLE
    # no committed row of this mode: bounds from the tuned T's neighbours
    b3 = Buckets(DIMS, TABLE, [64, 1024], "f")
    assert b3.key(64, False) == (*DIMS, False, 256) and b3.key(1024, False) == (*DIMS, False, INF)


@pytest.mark.parametrize("order", [[4096, 16384], [16384, 4096]])
def test_keys_do_not_depend_on_the_tuning_order(order) -> None:
    """Re-tuning the committed row's own T and a larger one in one run, in either order:
    4096 keeps (2048, 8192], 16384 takes (8192, inf]; no two tuned T share a key (a shared
    key once dropped the second row), and the committed row, re-tuned, is not moved."""
    b = Buckets(DIMS, TABLE, order, "g")
    assert b.key(4096, True) == (*DIMS, True, 8192)
    assert b.key(16384, True) == (*DIMS, True, INF)
    assert b.table == TABLE


def test_two_tuned_t_below_the_committed_row_share_its_bucket() -> None:
    """Bucket (2048, inf] measured at 16384; tuning 4096 and 6000: anchors 4096, 6000,
    16384, so 4096 -> (2048, 4957], 6000 -> (4957, 9914], and the committed row keeps
    (9914, inf] (its key and record unchanged)."""
    table = {
        **TABLE,
        (*DIMS, True, INF): dataclasses.replace(TABLE[(*DIMS, True, INF)], tuned_at=16384),
    }
    b = Buckets(DIMS, table, [6000, 4096], "i")
    assert b.key(4096, True) == (*DIMS, True, 4957)  # isqrt(4096 * 6000)
    assert b.key(6000, True) == (*DIMS, True, 9914)  # isqrt(6000 * 16384)
    assert b.table == table
    keys = [b.key(t, True) for t in (4096, 6000)]
    assert len(set(keys)) == 2 and (*DIMS, True, INF) not in keys


def test_a_bucket_without_a_measured_t_is_split_between_the_tuned_t() -> None:
    """A committed row that records no T: the tuned T inside its bucket share it, the
    largest taking the bucket's bound (replacing the row)."""
    table = {
        **TABLE,
        (*DIMS, True, INF): dataclasses.replace(TABLE[(*DIMS, True, INF)], tuned_at=None),
    }
    b = Buckets(DIMS, table, [4096, 16384], "j")
    assert b.key(4096, True) == (*DIMS, True, 8192)
    assert b.key(16384, True) == (*DIMS, True, INF)
    assert b.table == table
