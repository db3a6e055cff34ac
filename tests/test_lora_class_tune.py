"""The tune tool's LoRA classes on the CPU (benchmarks/tune.py runs on the GPU only): its
options, where a class row's T range comes from, what it starts from, the quick search's
candidates, the rows it writes and keeps, and scripts/gpu_lora_tune.sh's chaining of
tunes (with a stand-in for Python)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks import tune
from benchmarks.table_buckets import Buckets
from moelora.tiling.config import GemmTiles, TileConfig
from moelora.tiling.lora_class import REFERENCE, LoRAClass
from moelora.tiling.pick import H200, pick_config
from moelora.tiling.table import INF, Table, TableRow, load_table
from moelora.tiling.table_file import write_table

ROOT = Path(__file__).resolve().parent.parent
DIMS = (64, 8, 2048, 1024)  # OLMoE: no row in the committed table
C128 = LoRAClass(128, 8)
HEADER = dict(device="GPU", torch="t", triton="tr", commit="abc1234", time="today", iters=20)


def _row(lora: bool, bound: int, block_m: int, tuned_at: int, lora_class=REFERENCE, low=None):
    tiles = GemmTiles(64, 64)
    row = TableRow(DIMS, lora, bound, block_m, tiles, tiles, tuned_at=tuned_at, run="a")
    row = dataclasses.replace(row, before_ms=1.0, after_ms=0.9)
    return dataclasses.replace(row, lora_class=lora_class, min_tokens=low)


# REFERENCE buckets: LoRA-free (.., inf] at 4096; LoRA (.., 2048] at 1024, (2048, inf] at
# 4096; and an older 8x128 row over (2049, 8192], T 4096
TABLE = {
    r.key: r
    for r in (
        _row(False, INF, 16, 4096),
        _row(True, 2048, 32, 1024),
        _row(True, INF, 64, 4096),
        _row(True, 8192, 128, 4096, C128, 2049),
    )
}


def test_a_class_row_takes_the_reference_bucket_holding_its_t() -> None:
    b = Buckets(DIMS, TABLE, [], "r", modes=())
    assert b.class_bucket(1000, C128) == ((*DIMS, True, 2048, C128), 1)
    assert b.class_bucket(2048, C128) == ((*DIMS, True, 2048, C128), 1)  # the bound itself
    assert b.class_bucket(16384, C128) == ((*DIMS, True, INF, C128), 2049)
    # the 8x128 row's bound 8192 is no REFERENCE bucket: not a split point
    assert b.containing(5000, True) == (*DIMS, True, INF)
    other = Buckets((1, 1, 1, 1), TABLE, [], "r", modes=())
    assert other.class_bucket(64, C128) is None  # no REFERENCE LoRA row: tune that first


def test_only_the_modes_re_tuned_are_split() -> None:
    """A tune at T = 16384 splits the LoRA-free bucket measured at 4096 only when it
    re-tunes LoRA-free rows (--lora-only once moved that row to (.., 8192] and left the T
    above it to the heuristic); a class tune splits none."""
    assert (*DIMS, False, 8192) in Buckets(DIMS, TABLE, [16384], "s").table
    lora_only = Buckets(DIMS, TABLE, [16384], "s", modes=(True,))
    assert lora_only.table[(*DIMS, False, INF)] == TABLE[(*DIMS, False, INF)]
    assert lora_only.key(16384, True) == (*DIMS, True, INF)
    assert Buckets(DIMS, TABLE, [16384], "s", modes=()).table == TABLE


def test_a_class_row_is_written_and_read_back_with_its_class(tmp_path) -> None:
    cfg = TileConfig(64, GemmTiles(128, 64, 8, 4), GemmTiles(256, 64, 8, 4), expand_lanes=64)
    key, low = Buckets(DIMS, TABLE, [], "r", modes=()).class_bucket(16384, C128)
    row = tune.table_row(cfg, True, key, 16384, 9.1, 4.9, "abc1234", low)
    assert (row.lora_class, row.min_tokens, row.max_tokens) == (C128, 2049, INF)
    # the older 8x128 row (2049..8192) overlaps the new one and gives way; the rest stay
    kept = tune.with_kept_rows([row], {**H200.by_key(), **TABLE})
    assert TABLE[(*DIMS, True, 8192, C128)] not in kept and TABLE[(*DIMS, True, INF)] in kept
    path = tmp_path / "h200_table.json"
    write_table(path, kept, HEADER)
    back = load_table(path)
    assert back.by_key()[key] == row and len(back.rows) == len(H200.rows) + 4
    assert back.lookup(DIMS, True, 4096, LoRAClass(256, 8)) == row  # 8x256 -> nearest 8x128
    assert back.lookup(DIMS, True, 1024, LoRAClass(256, 8)) == TABLE[(*DIMS, True, 2048)]


def test_a_kept_class_row_elsewhere_stays() -> None:
    """Only an overlapping row of the same shape and class gives way."""
    old = TABLE[(*DIMS, True, 8192, C128)]
    new = dataclasses.replace(old, min_tokens=8193, max_tokens=INF)  # after it: no overlap
    other = dataclasses.replace(old, lora_class=LoRAClass(16, 64))  # another class
    assert tune.with_kept_rows([new], {old.key: old, other.key: other}) == [new, old, other]


# (id, options, (lora_class, lora_only)) — what each option set tunes
OPTIONS = [
    ("default", [], (REFERENCE, False)),
    ("reference-spelled-out", ["--rank", "16", "--adapters", "8"], (REFERENCE, False)),
    ("rank-class", ["--rank", "128"], (C128, True)),  # a class tunes LoRA rows only
    ("slot-class", ["--adapters", "64"], (LoRAClass(16, 64), True)),
]


@pytest.mark.parametrize("argv,want", [c[1:] for c in OPTIONS], ids=[c[0] for c in OPTIONS])
def test_options(argv, want) -> None:
    args = tune.parse_args(["--out", "t.json", *argv])
    assert (args.lora_class, args.lora_only) == want
    assert args.search == "full" and args.table_in is None


# (id, options, fragment of the refusal)
REFUSED = [
    ("rank-off-grid", ["--rank", "48"], "--rank 48: expected a rank class"),
    ("slots-off-grid", ["--adapters", "256"], "--adapters 256: expected a slot class"),
    ("class-knobs-only", ["--rank", "128", "--knobs-only"], "--knobs-only / --own-buckets"),
    ("class-own-buckets", ["--adapters", "64", "--own-buckets"], "LoRA class 64x16"),
]


@pytest.mark.parametrize("argv,fragment", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refused_options(argv, fragment, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        tune.parse_args(["--out", "t.json", *argv])
    assert done.value.code == 2 and fragment in capsys.readouterr().err


def test_a_class_tune_starts_from_its_nearest_row_and_the_lora_free_tiles() -> None:
    table = Table(tuple(TABLE.values()))
    args = tune.parse_args(["--out", "t.json", "--rank", "256"])  # untuned 8x256
    fitted = []

    def fit(cfg: TileConfig) -> TileConfig:
        fitted.append(cfg)
        return dataclasses.replace(cfg, shrink_block_k=32)  # what a fit could change

    chosen, start, others = tune.starts(4096, DIMS, True, table, args, fit)
    assert chosen.block_m == 128  # the 8x128 row: 1 step away (REFERENCE is 4)
    assert chosen in fitted and start == dataclasses.replace(chosen, shrink_block_k=32)
    lora_free, *classes = others
    assert lora_free.block_m == 16 and lora_free.expand_lanes == start.expand_lanes
    assert lora_free.shrink_block_k == 32  # fitted too
    # and every other class's row holding T (here REFERENCE's), fitted, none twice
    reference = pick_config(4096, *DIMS, lora=True, table=table)
    assert classes == [dataclasses.replace(reference, shrink_block_k=32)]


class FakeLayer:
    """Layer.measure on the CPU: a fixed time per config (its hash), every config recorded."""

    def __init__(self) -> None:
        self.seen: list[TileConfig] = []

    def measure(self, cfg: TileConfig, lora: bool) -> float:
        self.seen.append(cfg)
        return 1.0 + hash(cfg) % 997 / 997


LAYOUT = ("down", "z_sorted", "down_tma", "half_tail", "up_tma", "atomic_reduce")


def test_the_quick_search_skips_down_tiles_and_layout_knobs() -> None:
    start = tune.aligned_config(tune.pick_config(4096, *DIMS, lora=True), 4096, 8, 2, True)
    other = dataclasses.replace(start, block_m=start.block_m // 2)
    quick, full = FakeLayer(), FakeLayer()
    tune.search(quick, start, True, [], (other,), quick=True)
    tune.search(full, start, True, [], (other,))
    layouts = {tuple(getattr(c, k) for k in LAYOUT) for c in (start, other)}
    assert all(tuple(getattr(c, k) for k in LAYOUT) in layouts for c in quick.seen)
    ups = {c.up for c in quick.seen}
    assert {GemmTiles(*t) for t in tune.UP[tune._size(start.block_m)]} <= ups | {start.up}
    assert {c.lora_delta for c in quick.seen} == {False, True}
    assert len(quick.seen) < len(full.seen)


FAKE_PYTHON = """#!/usr/bin/env bash
# benchmarks.tune's stand-in: logs its arguments, writes --out = --table-in's text + a line
echo "$*" >> "$TUNE_CALLS"
while [ $# -gt 0 ]; do
  case "$1" in --out) out=$2; shift;; --table-in) tin=$2; shift;; esac; shift
done
{ [ -n "${tin:-}" ] && cat "$tin"; echo "tuned into $(basename "$out")"; } > "$out"
"""


def test_the_script_chains_the_tunes(tmp_path) -> None:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out, calls = tmp_path / "out", tmp_path / "calls.txt"
    env = {**os.environ, "PYTHON": str(fake), "OUT": str(out), "TUNE_CALLS": str(calls)}
    env.update(CLASSES="8x128 64x16", TOKENS="256,4096", TUNE_S="30", MODEL="m")
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_lora_tune.sh"), "--iters", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    first, second = calls.read_text().splitlines()
    assert "--adapters 8 --rank 128 --tokens 256,4096 --search quick --budget-s 30" in first
    assert "--table-in" not in first and first.endswith("--iters 5")  # the packaged table
    assert "--model m" in first and f"--out {out}/table_8x128.json" in first
    assert "--adapters 64 --rank 16" in second and f"--table-in {out}/table_8x128.json" in second
    final = (out / "h200_table.json").read_text().splitlines()
    assert final == ["tuned into table_8x128.json", "tuned into table_64x16.json"]
    assert "table: " in done.stdout
