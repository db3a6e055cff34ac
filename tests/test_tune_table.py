"""The tune's table writer: what it writes is what pick_config reads back, and rows it
does not re-tune keep their comments (which run chose them)."""

from __future__ import annotations

import dataclasses
import importlib.util

from benchmarks.tune import _row, committed_notes, with_kept_rows, write_table
from moelora.kernels import configs
from moelora.kernels.h200_table import H200_ROWS

HEADER = dict(device="GPU", torch="t", triton="tr", commit="abc1234", time="today", iters=20)


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
