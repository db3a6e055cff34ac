"""Tile configuration choice: table rows, their LoRA knobs, and the rules beneath them."""

from __future__ import annotations

import dataclasses

import pytest

from moelora.tiling import heuristic, pick
from moelora.tiling.config import LORA_KNOBS, GemmTiles, TileConfig
from moelora.tiling.pick import pick_config
from moelora.tiling.table import INF, Table, TableRow

QWEN3 = (128, 8, 2048, 768)


def _table(lora: bool, max_tokens: int, knobs: dict) -> Table:
    """One row for QWEN3 (BLOCK_M 32, 64 x 64 tiles) serving T up to max_tokens."""
    tiles = GemmTiles(64, 64)
    return Table((TableRow(QWEN3, lora, max_tokens, 32, tiles, tiles, knobs),))


def test_table_row_knobs_override_the_rules(monkeypatch) -> None:
    monkeypatch.setattr(pick, "H200", _table(True, 64, {"expand_lanes": 32, "shrink_block_m": 64}))
    cfg = pick_config(33, *QWEN3, lora=True)
    assert (cfg.block_m, cfg.expand_lanes, cfg.shrink_block_m) == (32, 32, 64)
    assert cfg.shrink_split_k == heuristic.shrink_split_rule(33 * 8)  # not in the row: the rule
    base = pick_config(33, *QWEN3, lora=False)  # LoRA-free: no row here -> the heuristic
    assert base == heuristic.heuristic(33 * 8 / 128)


@pytest.mark.parametrize("tokens", [1, 16, 300, 5000, 70000])
def test_off_table_shapes_take_the_heuristic_and_rules(tokens: int) -> None:
    dims = (96, 6, 1536, 512)  # no table row
    m = tokens * 6 / 96
    cfg = pick_config(tokens, *dims, lora=True)
    want = heuristic.lora_heuristic(m)
    assert (cfg.block_m, cfg.up, cfg.down) == (want.block_m, want.up, want.down)
    assert cfg.shrink_split_k == heuristic.shrink_split_rule(tokens * 6)
    assert cfg.shrink_block_m == heuristic.shrink_block_m_rule(m)


def test_committed_table_knobs_are_valid() -> None:
    for row in pick.H200.rows:
        key, knobs = row.key, row.knobs
        assert knobs.get("half_tail", 0) in (1, 2, 3) or "half_tail" not in knobs, key
        # aligned-path PDL measured no gain (docs/history/kernel_log.md v13b): decode rows only
        assert knobs.get("decode", False) or not knobs.get("pdl"), f"{key}: pdl needs decode"
        assert knobs.get("expand_lanes", 16) in (16, 32, 64, 128), key
        assert knobs.get("shrink_block_m", 16) in (16, 32, 64, 128), key
        rows, block_k = knobs.get("decode_shrink", (1, 16))
        assert rows & (rows - 1) == 0 and block_k & (block_k - 1) == 0, key  # powers of two
        assert key[4] or not set(knobs) & LORA_KNOBS, f"{key}: LoRA knobs on a LoRA-free row"
        assert knobs.get("z_sorted", False) or not knobs.get("down_tma"), (
            f"{key}: TMA needs z_sorted"
        )


def test_layout_knobs_apply_to_lora_free_rows(monkeypatch) -> None:
    monkeypatch.setattr(pick, "H200", _table(False, 64, {"z_sorted": True, "down_tma": True}))
    cfg = pick_config(40, *QWEN3, lora=False)
    assert (cfg.block_m, cfg.z_sorted, cfg.down_tma) == (32, True, True)


def test_rows_serve_their_t_range_only(monkeypatch) -> None:
    """A row serves T up to its bound; above the last bound the heuristic takes over."""
    monkeypatch.setattr(pick, "H200", _table(False, 64, {}))
    assert pick_config(64, *QWEN3).block_m == 32
    assert pick_config(65, *QWEN3) == heuristic.heuristic(65 * 8 / 128)
    monkeypatch.setattr(pick, "H200", _table(False, INF, {}))
    assert pick_config(10**6, *QWEN3).block_m == 32


@pytest.mark.parametrize("lora", [False, True])
def test_decode_path_only_from_table_rows(lora: bool) -> None:
    """Off the table the heuristic stays aligned at every T (the decode path lost on other
    shapes with the Qwen3 tiles); the committed Qwen3 rows take it at T = 1."""
    for tokens in (1, 2, 4):
        assert not pick_config(tokens, 96, 6, 1536, 512, lora=lora).decode
    assert pick_config(1, *QWEN3, lora=lora).decode


def test_aligned_config_of_a_decode_row_is_the_off_table_config() -> None:
    """The aligned side of a decode row takes the heuristic tiles and the LoRA rules, not
    the decode row's (untuned) LoRA knobs."""
    decode = dataclasses.replace(heuristic.DECODE_TILES, expand_lanes=64, shrink_split_k=1)
    got = heuristic.aligned_config(decode, 4, 128, 8, True)
    want = heuristic.lora_heuristic(4 * 8 / 128)
    assert not got.decode and (got.block_m, got.up, got.down) == (want.block_m, want.up, want.down)
    assert got.shrink_split_k == heuristic.shrink_split_rule(4 * 8) and got.expand_lanes == 32
    assert got == pick_config(4, 128, 8, 1536, 512, lora=True)  # = the off-table choice
    aligned = heuristic.heuristic(2.0)
    assert heuristic.aligned_config(aligned, 32, 128, 8, False) is aligned


def test_tile_config_defaults_are_the_knobs_off() -> None:
    """A row's knobs it does not name stay off: what pick_config relies on."""
    cfg = TileConfig(16, GemmTiles(64, 64), GemmTiles(64, 64))
    assert not any(getattr(cfg, k) for k in ("decode", "lora_delta", "pdl", "atomic_reduce"))
    assert cfg.half_tail == 0 and not (cfg.z_sorted or cfg.down_tma or cfg.up_tma)


def test_each_knob_is_declared_once_as_data() -> None:
    """KNOB_SPECS covers every TileConfig knob; each default and each value the H200 table
    sets is among the knob's declared values, and the LoRA-only ones are LORA_KNOBS."""
    from moelora.tiling.config import KNOB_SPECS, KNOBS
    from moelora.tiling.pick import H200

    assert sorted(k.name for k in KNOB_SPECS) == sorted(KNOBS)  # once each
    default = TileConfig(16, GemmTiles(32, 32), GemmTiles(32, 32))
    for knob in KNOB_SPECS:
        assert getattr(default, knob.name) in knob.values, knob.name
        assert (knob.name in LORA_KNOBS) == knob.lora_only, knob.name
    for row in H200.rows:
        for name, value in row.knobs.items():
            spec = next(k for k in KNOB_SPECS if k.name == name)
            assert value in spec.values, (row.key, name, value)
