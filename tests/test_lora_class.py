"""LoRA classes (tiling/lora_class.py) in the tile table: a bank's class, class rows in the
file (their record, range rules and errors), the nearest-class lookup, and its use by
pick_config and the backend's forward_plan."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from moelora.errors import ConfigError
from moelora.tiling import pick
from moelora.tiling.config import GemmTiles
from moelora.tiling.lora_class import REFERENCE, LoRAClass
from moelora.tiling.pick import H200, pick_config
from moelora.tiling.table import INF, Table, TableError, TableRow, load_table
from moelora.tiling.table_file import table_json, write_table

QWEN3 = (128, 8, 2048, 768)
TILES = {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3}

# (id, tile_rank, num_slots, class) — the rounding up to each grid
CLASS_OF = [
    ("empty-bank", 0, 0, (16, 8)),  # tile rank 0 (no adapter loaded yet): the smallest class
    ("below-grid", 4, 2, (16, 8)),
    ("reference", 16, 8, (16, 8)),  # on both bounds: the bound itself
    ("just-above", 17, 9, (32, 16)),
    ("between", 100, 33, (128, 64)),
    ("top-edges", 256, 128, (256, 128)),
    ("above-grid", 512, 1024, (256, 128)),  # the top class (the kernels cap R at 256)
]


@pytest.mark.parametrize("rank,slots,want", [c[1:] for c in CLASS_OF], ids=[c[0] for c in CLASS_OF])
def test_class_of_a_bank(rank: int, slots: int, want: tuple) -> None:
    assert LoRAClass.of(rank, slots) == LoRAClass(*want)


def test_class_values_and_distance() -> None:
    assert REFERENCE == LoRAClass(16, 8) and str(LoRAClass(128, 8)) == "8x128"
    assert REFERENCE.distance(LoRAClass(128, 8)) == 3  # three rank doublings
    assert REFERENCE.distance(LoRAClass(16, 128)) == 4  # four slot doublings
    assert LoRAClass(64, 16).distance(REFERENCE) == 3  # symmetric, both axes add
    with pytest.raises(ConfigError, match=r"lora_class\.rank.*48.*\[16, 32, 64, 128, 256\]"):
        LoRAClass(48, 8)
    with pytest.raises(ConfigError, match=r"num_slots.*-1"):
        LoRAClass.of(16, -1)


def _row(low: int, high: int | None, note: str, lora_class=None, lora: bool = True) -> dict:
    """A record for QWEN3 serving [low, high], named by its note; lora_class (rank, slots)."""
    record = {
        "shape": {"experts": 128, "top_k": 8, "hidden": 2048, "intermediate": 768},
        "lora": lora,
        "tokens": {"from": low, "to": high},
        "block_m": 32,
        "up": TILES,
        "down": TILES,
        "knobs": {},
        "note": note,
    }
    if lora_class is not None:
        record["lora_class"] = {"rank": lora_class[0], "slots": lora_class[1]}
    return record


# REFERENCE-class rows tile T from 1; the other classes hold a few ranges, with a gap
RECORDS = [
    _row(1, None, "lora-free", lora=False),
    _row(1, 64, "ref-small"),
    _row(65, None, "ref-large"),
    _row(65, 2048, "8x128", (128, 8)),
    _row(1, 16, "8x64-low", (64, 8)),
    _row(4097, None, "8x64-high", (64, 8)),  # 17..4096: a gap
    _row(1, None, "32x16", (16, 32)),
]


CLASS_OF_NOTE = {"8x128": (128, 8), "8x64-low": (64, 8), "8x64-high": (64, 8), "32x16": (16, 32)}


def _write(tmp_path: Path, records: list) -> Path:
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"format": 1, "last_run": {"commit": "abc"}, "rows": records}))
    return path


@pytest.fixture
def table(tmp_path) -> Table:
    return load_table(_write(tmp_path, RECORDS))


# (id, wanted class (rank, slots) or None, T, the note of the row served) — each a rule
LOOKUPS = [
    ("exact-class", (128, 8), 100, "8x128"),
    ("nearest-class", (256, 8), 100, "8x128"),  # 1 step from 8x128, 4 from REFERENCE
    ("none-is-reference", None, 100, "ref-large"),
    ("reference-itself", (16, 8), 10, "ref-small"),  # 0 steps, though 8x64 holds T = 10 too
    # 8x128 ends at 2048 and 8x64 has a gap there: the nearest class holding T is REFERENCE
    ("outside-range-falls-back", (128, 8), 3000, "ref-large"),
    ("outside-range-next-nearest", (128, 8), 5000, "8x64-high"),  # 8x64 holds 4097..
    ("far-class-reference", (256, 8), 3000, "ref-large"),  # 4 steps; 32x16 is 4 + 2
    # ties: 1 step to REFERENCE and to 8x64 -> the larger rank class
    ("tie-larger-rank", (32, 8), 10, "8x64-low"),
    # 1 step to REFERENCE and to 32x16 (same rank class) -> the larger slot class
    ("tie-larger-slots", (16, 16), 100, "32x16"),
    ("many-slots", (16, 128), 100, "32x16"),  # 2 steps; REFERENCE 4
]


@pytest.mark.parametrize("want,tokens,note", [c[1:] for c in LOOKUPS], ids=[c[0] for c in LOOKUPS])
def test_lookup_takes_the_nearest_class_holding_t(table, want, tokens, note) -> None:
    lora_class = None if want is None else LoRAClass(*want)
    row = table.lookup(QWEN3, True, tokens, lora_class)
    assert row.note == note
    served = REFERENCE if note.startswith("ref") else LoRAClass.of(*CLASS_OF_NOTE[note])
    assert row.lora_class == served  # the row says which class served it


def test_lookup_without_lora_or_rows(table) -> None:
    assert table.lookup(QWEN3, False, 100, LoRAClass(128, 8)).note == "lora-free"
    assert table.lookup((8, 2, 4096, 14336), True, 100, LoRAClass(128, 8)) is None
    assert table.lookup(QWEN3, True, INF, LoRAClass(64, 8)).note == "8x64-high"


def test_class_rows_load_with_their_class_and_range(table) -> None:
    rows = {r.note: r for r in table.rows}
    assert rows["8x128"].lora_class == LoRAClass(128, 8)
    assert (rows["8x128"].min_tokens, rows["8x128"].max_tokens) == (65, 2048)
    assert rows["ref-large"].lora_class == REFERENCE and rows["ref-large"].min_tokens is None
    assert rows["8x128"].key == (*QWEN3, True, 2048, LoRAClass(128, 8))
    assert rows["ref-large"].key == (*QWEN3, True, INF)  # REFERENCE keys: as before classes
    assert len(table.by_key()) == len(RECORDS)


def _with(i: int, **change) -> list:
    """RECORDS with record i changed (lora_class=None removes the field)."""
    records = copy.deepcopy(RECORDS)
    for key, value in change.items():
        if value is None:
            del records[i][key]
        else:
            records[i][key] = value
    return records


# (id, records, what the message must name) — each a distinct defect of a class row
BAD = [
    (
        "overlap",
        [*RECORDS, _row(2000, 3000, "8x128-again", (128, 8))],  # 2000 <= 8x128's 2048
        r"8x128.*tokens\.from = 2000.*more than 2048.*LoRA class 8x128.*not overlap",
    ),
    ("rank-off-grid", _with(3, lora_class={"rank": 48, "slots": 8}), r"lora_class\.rank = 48"),
    (
        "slots-off-grid",
        _with(3, lora_class={"rank": 128, "slots": 256}),
        r"lora_class\.slots = 256.*\[8, 16, 32, 64, 128\]",
    ),
    ("bool-rank", _with(3, lora_class={"rank": True, "slots": 8}), r"lora_class\.rank = True"),
    ("missing-slots", _with(3, lora_class={"rank": 128}), r"lora_class.*missing \['slots'\]"),
    (
        "on-lora-free",
        _with(0, lora_class={"rank": 128, "slots": 8}),
        r"row 0 .*LoRA-free.*lora_class.*no lora_class on a LoRA-free row",
    ),
    # REFERENCE rows still tile T from 1: a gap there is an error, as before classes
    ("reference-gap", _with(2, tokens={"from": 70, "to": None}), r"tokens\.from = 70.*65"),
]


@pytest.mark.parametrize("records,names", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_a_bad_class_row_names_the_row_field_and_fix(tmp_path, records, names) -> None:
    path = _write(tmp_path, records)
    with pytest.raises(TableError, match=names) as err:
        load_table(path)
    assert str(path) in str(err.value) and "Fix: re-run benchmarks/tune.py" in str(err.value)


def test_an_explicit_reference_class_is_the_reference(tmp_path) -> None:
    records = _with(2, lora_class={"rank": 16, "slots": 8})
    row = load_table(_write(tmp_path, records)).lookup(QWEN3, True, 100)
    assert row.note == "ref-large" and row.lora_class == REFERENCE and row.min_tokens is None


def test_class_rows_round_trip(tmp_path, table) -> None:
    path = tmp_path / "again.json"
    write_table(path, table.rows, table.last_run)
    back = load_table(path)  # the rows in the file's order (TableRow.order)
    assert back.by_key() == table.by_key() and back.last_run == table.last_run
    text = path.read_text()
    assert text == table_json(load_table(path).rows, table.last_run)  # a fixed point
    records = {r["note"]: r for r in json.loads(text)["rows"]}
    assert records["8x64-high"]["tokens"] == {"from": 4097, "to": None}  # its own from
    assert records["8x128"]["lora_class"] == {"rank": 128, "slots": 8}
    assert "lora_class" not in records["ref-large"]  # REFERENCE rows: as before classes
    notes = [r["note"] for r in json.loads(text)["rows"]]  # by mode, then class, then T
    assert notes == ["lora-free", "ref-small", "ref-large", "32x16", "8x64-low", "8x64-high", "8x128"]  # fmt: skip


def test_the_committed_table_rewrites_byte_identically(tmp_path) -> None:
    """The packaged table (REFERENCE rows and class rows) reads back and re-writes as is."""
    committed = (Path(pick.__file__).parent / "h200_table.json").read_text()
    assert any(r.lora_class == REFERENCE for r in H200.rows)
    assert table_json(H200.rows, H200.last_run) == committed
    write_table(tmp_path / "h200_table.json", H200.rows, H200.last_run)
    assert (tmp_path / "h200_table.json").read_text() == committed


def test_a_table_row_checks_its_class() -> None:
    tiles = GemmTiles(64, 64)
    with pytest.raises(ValueError, match="lora_class"):
        TableRow(QWEN3, False, INF, 32, tiles, tiles, lora_class=LoRAClass(128, 8), min_tokens=1)
    with pytest.raises(ValueError, match="min_tokens"):
        TableRow(QWEN3, True, INF, 32, tiles, tiles, lora_class=LoRAClass(128, 8))


def _code_table(dims: tuple = QWEN3) -> Table:
    """REFERENCE rows BLOCK_M 16 (LoRA-free and LoRA), a class row for 64 slots of rank 16
    with BLOCK_M 64 and one for 8 slots of rank 128 with BLOCK_M 128: the row picked shows."""
    tiles = GemmTiles(64, 64)

    def row(lora: bool, block_m: int, lora_class: LoRAClass = REFERENCE) -> TableRow:
        low = None if lora_class == REFERENCE else 1  # a class row serves T from 1 on
        row = TableRow(dims, lora, INF, block_m, tiles, tiles)
        return dataclasses.replace(row, lora_class=lora_class, min_tokens=low)

    return Table(
        (
            row(False, 16),
            row(True, 16),
            row(True, 64, LoRAClass(16, 64)),
            row(True, 128, LoRAClass(128, 8)),
        )
    )


# (id, tile rank, slots, BLOCK_M of the row picked)
PICKS = [
    ("no-bank-given", 0, 0, 16),  # the defaults: the REFERENCE class
    ("reference-bank", 16, 8, 16),
    ("many-slots", 8, 50, 64),  # class 64x16: its own row
    ("high-rank", 100, 8, 128),  # class 8x128
    ("rank-256", 256, 8, 128),  # untuned 8x256: its nearest neighbour 8x128
]


@pytest.mark.parametrize("rank,slots,block_m", [c[1:] for c in PICKS], ids=[c[0] for c in PICKS])
def test_pick_config_picks_the_class_row(rank: int, slots: int, block_m: int) -> None:
    cfg = pick_config(100, *QWEN3, lora=True, table=_code_table(), rank=rank, slots=slots)
    assert cfg.block_m == block_m
    # LoRA-free: the class does not enter
    assert pick_config(100, *QWEN3, table=_code_table(), rank=rank, slots=slots).block_m == 16


def test_forward_plan_picks_by_the_banks_class(monkeypatch) -> None:
    """The backend passes the bank's tile rank and slots: a 64-slot bank gets the 64x16
    row, a bank of rank 128 whose largest loaded rank is 16 the REFERENCE row; and with a
    GPU the picked row is fitted at the bank's rank (the fit the backend ran before)."""
    from moelora.activations import Activation
    from moelora.backends import triton as backend
    from moelora.config import MoEShape
    from moelora.device import GpuLimits
    from moelora.tiling.fit import fit_to_device
    from moelora.weights import random_expert_weights, random_lora_bank

    shape = MoEShape(*QWEN3[:2], 32, 16, Activation.SILU, dtype=torch.float32)
    dims = (QWEN3[0], QWEN3[1], 32, 16)
    table = _code_table(dims)
    monkeypatch.setattr(pick, "H200", table)
    experts = random_expert_weights(shape)
    x, ids = torch.zeros(5, 32), torch.zeros(5, QWEN3[1], dtype=torch.int32)

    many = random_lora_bank(shape, 64, 4)
    plan = backend.forward_plan(x, ids, experts, many, shape)
    assert plan.tiles == pick_config(5, *dims, lora=True, table=table, rank=4, slots=64)
    assert plan.tiles.block_m == 64
    wide = random_lora_bank(shape, 2, 128, ranks=[16, 8])  # R = 128, tile rank 16
    assert backend.forward_plan(x, ids, experts, wide, shape).tiles.block_m == 16
    high = random_lora_bank(shape, 2, 128)
    assert backend.forward_plan(x, ids, experts, high, shape).tiles.block_m == 128

    limits = GpuLimits(232448, 9)  # an H200's shared memory: the backend fits the class row
    monkeypatch.setattr(backend, "gpu_limits", lambda device: limits)
    picked = pick_config(5, *dims, lora=True, table=table, rank=128, slots=2)
    want = fit_to_device(picked, 2, torch.float32, limits, rank=128, num_slots=2)
    assert backend.forward_plan(x, ids, experts, high, shape).tiles == want
