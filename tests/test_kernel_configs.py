"""Tile configuration choice: table rows, their LoRA knobs, and the rules beneath them."""

from __future__ import annotations

import dataclasses

import pytest

from moelora.kernels import configs
from moelora.kernels.configs import GemmTiles, TileConfig, pick_config

QWEN3 = (128, 8, 2048, 768)


def test_table_row_knobs_override_the_rules(monkeypatch) -> None:
    key = (*QWEN3, True, 64)
    row = TileConfig(32, GemmTiles(64, 64), GemmTiles(64, 64))
    monkeypatch.setattr(configs, "H200_TABLE", {key: row})
    monkeypatch.setattr(configs, "H200_KNOBS", {key: {"expand_lanes": 32, "shrink_block_m": 64}})
    cfg = pick_config(33, *QWEN3, lora=True)
    assert (cfg.block_m, cfg.expand_lanes, cfg.shrink_block_m) == (32, 32, 64)
    assert cfg.shrink_split_k == configs._shrink_split(33 * 8)  # not in the row: the rule
    base = pick_config(33, *QWEN3, lora=False)  # LoRA-free: no row here -> the heuristic
    assert base == configs._heuristic(33 * 8 / 128)


@pytest.mark.parametrize("tokens", [1, 16, 300, 5000, 70000])
def test_off_table_shapes_take_the_heuristic_and_rules(tokens: int) -> None:
    dims = (96, 6, 1536, 512)  # no table row
    m = tokens * 6 / 96
    cfg = pick_config(tokens, *dims, lora=True)
    want = configs._lora_heuristic(m)
    assert (cfg.block_m, cfg.up, cfg.down) == (want.block_m, want.up, want.down)
    assert cfg.shrink_split_k == configs._shrink_split(tokens * 6)
    assert cfg.shrink_block_m == configs._shrink_block_m(m)


def test_committed_table_knobs_are_valid() -> None:
    lora_knobs = {
        "expand_lanes",
        "shrink_block_m",
        "shrink_split_k",
        "lora_delta",
        "delta_in_reduce",
        "shrink_expand",
        "expand_first",
    }
    for key, knobs in configs.H200_KNOBS.items():
        layout = {"z_sorted", "down_tma", "up_tma", "decode", "decode_shrink", "pdl", "half_tail"}
        layout.add("atomic_reduce")
        assert knobs.get("half_tail", 0) in (1, 2, 3) or "half_tail" not in knobs, key
        assert set(knobs) <= lora_knobs | layout, key
        # aligned-path PDL measured no gain (KERNEL_LOG.md v13b): decode rows only
        assert knobs.get("decode", False) or not knobs.get("pdl"), f"{key}: pdl needs decode"
        assert knobs.get("expand_lanes", 16) in (16, 32, 64, 128), key
        assert knobs.get("shrink_block_m", 16) in (16, 32, 64, 128), key
        rows, block_k = knobs.get("decode_shrink", (1, 16))
        assert rows & (rows - 1) == 0 and block_k & (block_k - 1) == 0, key  # powers of two
        assert key[4] or not set(knobs) & lora_knobs, f"{key}: LoRA knobs on a LoRA-free row"
        assert knobs.get("z_sorted", False) or not knobs.get("down_tma"), (
            f"{key}: TMA needs z_sorted"
        )


def test_layout_knobs_apply_to_lora_free_rows(monkeypatch) -> None:
    key = (*QWEN3, False, 64)
    row = TileConfig(32, GemmTiles(64, 64), GemmTiles(64, 64))
    monkeypatch.setattr(configs, "H200_TABLE", {key: row})
    monkeypatch.setattr(configs, "H200_KNOBS", {key: {"z_sorted": True, "down_tma": True}})
    cfg = pick_config(40, *QWEN3, lora=False)
    assert (cfg.block_m, cfg.z_sorted, cfg.down_tma) == (32, True, True)


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
    decode = dataclasses.replace(configs.DECODE_TILES, expand_lanes=64, shrink_split_k=1)
    got = configs.aligned_config(decode, 4, 128, 8, True)
    want = configs._lora_heuristic(4 * 8 / 128)
    assert not got.decode and (got.block_m, got.up, got.down) == (want.block_m, want.up, want.down)
    assert got.shrink_split_k == configs._shrink_split(4 * 8) and got.expand_lanes == 32
    assert got == pick_config(4, 128, 8, 1536, 512, lora=True)  # = the off-table choice
    aligned = configs._heuristic(2.0)
    assert configs.aligned_config(aligned, 32, 128, 8, False) is aligned
