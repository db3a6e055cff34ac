"""The H200 tile table as data: one JSON record per row (tiling/h200_table.json).

benchmarks/tune.py writes the file on the GPU (`tiling/table_file.py`); `load_table` reads it
back and checks every record, so a malformed file fails at import with a `TableError`
that names the file, the row and the field. A row serves one model shape (E, K, H, I)
and mode (LoRA or not) for the tokens T in [tokens.from, tokens.to] (to null: no upper
bound). A LoRA row also belongs to a LoRA class (tiling/lora_class.py: the bank's rank and
slots it was tuned with; REFERENCE, 8 adapters of rank 16, unless it says otherwise). The
REFERENCE-class rows of one shape and mode tile T from 1 without gaps; the rows of another
class are tuned at a few T only, so they may start above 1 and leave gaps, but never
overlap. A LoRA lookup takes the nearest class that has a row for T (`Table.lookup`).

Record fields: shape {experts, top_k, hidden, intermediate}, lora, tokens {from, to},
block_m, up / down {block_n, block_k, num_warps, num_stages}, knobs (TileConfig fields,
only those the tune set), tuned {tokens, run, before_ms, after_ms} (the T it was timed
at, the commit of that run, the starting and the chosen config's ms), note, and on a LoRA
row of another class than REFERENCE, lora_class {rank, slots} (absent: REFERENCE).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..errors import ConfigError
from .config import KNOBS, LORA_KNOBS, GemmTiles, TileConfig
from .lora_class import REFERENCE, LoRAClass

FORMAT = 1
INF = 2**31 - 1  # the upper T bound of a row whose tokens.to is null
H200_TABLE_FILE = "h200_table.json"

_ROW_FIELDS = {
    "shape",
    "lora",
    "lora_class",
    "tokens",
    "block_m",
    "up",
    "down",
    "knobs",
    "tuned",
    "note",
}
SHAPE_FIELDS = ("experts", "top_k", "hidden", "intermediate")
TILE_FIELDS = ("block_n", "block_k", "num_warps", "num_stages")
_TUNED_FIELDS = {"tokens": int, "run": str, "before_ms": float, "after_ms": float}


class TableError(ConfigError):
    """A tile table file is unreadable or one of its rows is malformed."""

    def __init__(self, where: str, value: object, expected: str) -> None:
        self.key, self.value, self.expected = where, value, expected
        fix = "re-run benchmarks/tune.py or fix that row"
        Exception.__init__(self, f"tile table {where} = {value!r}: expected {expected}. Fix: {fix}")


@dataclass(frozen=True)
class TableRow:
    """One row: the tiles and knobs measured fastest for a shape, a mode and a T range."""

    shape: tuple[int, int, int, int]  # (E, K, H, I)
    lora: bool
    max_tokens: int  # the row serves T up to this (INF: no bound), above the previous row
    block_m: int
    up: GemmTiles
    down: GemmTiles
    knobs: dict = field(default_factory=dict)
    tuned_at: int | None = None  # the T its run timed it at
    run: str = ""  # the commit of the run that chose it
    before_ms: float | None = None  # the starting config's time at tuned_at
    after_ms: float | None = None  # the chosen config's time at tuned_at
    note: str = ""  # what happened to the row since (a split bucket, a hand edit)
    lora_class: LoRAClass = REFERENCE  # the bank class it was tuned with (LoRA rows only)
    # The smallest T a row of another class than REFERENCE serves (its record's tokens.from;
    # such rows may leave gaps). None on a REFERENCE-class row: it serves the T above the
    # previous row's bound, so its tokens.from follows from the table.
    min_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.lora_class != REFERENCE and not self.lora:
            raise ValueError(
                f"lora_class: {self.lora_class} on a LoRA-free row; expected REFERENCE"
            )
        if (self.min_tokens is None) != (self.lora_class == REFERENCE):
            raise ValueError(
                f"min_tokens: {self.min_tokens} on a row of class {self.lora_class}; expected the "
                "smallest T it serves on a row of another class than REFERENCE, else None"
            )

    @property
    def key(self) -> tuple:
        """(E, K, H, I, LoRA on, T upper bound), and the LoRA class after it on a row of
        another class than REFERENCE: the row's place in the table (the keys of a table
        without class rows are those of before classes)."""
        key = (*self.shape, self.lora, self.max_tokens)
        return key if self.lora_class == REFERENCE else (*key, self.lora_class)

    @property
    def order(self) -> tuple:
        """The file's order: by shape, LoRA-free rows first, then by class (REFERENCE, the
        smallest, first), then by T."""
        return (*self.shape, self.lora, self.lora_class, self.max_tokens)

    def config(self) -> TileConfig:
        """The row's tiles with its knobs (knobs it does not set keep TileConfig's defaults)."""
        return TileConfig(self.block_m, self.up, self.down, **self.knobs)

    def describe(self) -> str:
        """One line: the T it was timed at, the times, the run, the note."""
        text = ""
        if self.tuned_at is not None:
            text = f"T={self.tuned_at}: {self.before_ms:.4f} -> {self.after_ms:.4f} ms"
            text += f" ({self.run} run)"
        return "; ".join(t for t in (text, self.note) if t)


@dataclass(frozen=True)
class Table:
    """The rows of a tile table file, looked up by shape, mode, LoRA class and T."""

    rows: tuple[TableRow, ...]
    last_run: dict = field(default_factory=dict)  # device, versions and commit of the last tune
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict = {}  # (shape, lora) -> {class: its rows by T bound}
        for row in sorted(self.rows, key=lambda r: r.order):
            index.setdefault((row.shape, row.lora), {}).setdefault(row.lora_class, []).append(row)
        # with each class's T bounds, built once here: every forward looks a row up
        for classes in index.values():
            for c, rows in classes.items():
                classes[c] = ([r.max_tokens for r in rows], rows)
        object.__setattr__(self, "_index", index)

    def lookup(
        self,
        shape: tuple[int, int, int, int],
        lora: bool,
        tokens: int,
        lora_class: LoRAClass | None = None,
    ) -> TableRow | None:
        """The row serving T = tokens for this shape and mode, else None. With LoRA, of the
        classes with a row holding T the nearest to `lora_class` (None: REFERENCE) by
        LoRAClass.distance; ties go to the larger rank class, then the larger slot class
        (a larger class's tiles were fitted for more shared memory). The row's lora_class
        says which class served it."""
        want = REFERENCE if lora_class is None else lora_class
        found = self.holding(shape, lora, tokens)
        return min(found, key=lambda r: want.preference(r.lora_class), default=None)

    def holding(self, shape: tuple[int, int, int, int], lora: bool, tokens: int) -> list:
        """Of each class of this shape and mode, its row whose T range holds `tokens` (a
        class without one has none here)."""
        classes = self._index.get((shape, lora), {}).values()
        return [row for group in classes if (row := _holding(*group, tokens)) is not None]

    def by_key(self) -> dict[tuple, TableRow]:
        return {row.key: row for row in self.rows}


def _holding(bounds: list[int], rows: list[TableRow], tokens: int) -> TableRow | None:
    """Of the rows of one shape, mode and class (by T bound), the one whose T range holds
    `tokens`, else None (a REFERENCE-class row holds the T above the row before it)."""
    i = bisect.bisect_left(bounds, tokens)
    if i == len(rows) or (rows[i].min_tokens is not None and rows[i].min_tokens > tokens):
        return None
    return rows[i]


def load_table(path: str | Path | None = None) -> Table:
    """The table in `path` (default: the packaged H200 table), every row checked."""
    if path is None:
        source = resources.files(__package__).joinpath(H200_TABLE_FILE)
        name = f"moelora/tiling/{H200_TABLE_FILE}"
    else:
        source, name = Path(path), str(path)
    try:
        data = json.loads(source.read_text())
    except OSError as err:
        raise TableError(name, f"unreadable ({err})", "a tile table JSON file") from err
    except ValueError as err:
        raise TableError(name, f"not JSON ({err})", "a tile table JSON file") from err
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise TableError(f"{name}: format", got, f"{FORMAT} (an object with format and rows)")
    records = data.get("rows")
    if not isinstance(records, list):
        raise TableError(f"{name}: rows", type(records).__name__, "a list of row records")
    rows = tuple(_row(name, i, record) for i, record in enumerate(records))
    _check_ranges(name, records, rows)
    return Table(rows, dict(data.get("last_run", {})))


def _where(name: str, i: int, record: object) -> str:
    """'<file> row <i> (E=.. K=.. H=.. I=.., LoRA, T a..b)' as far as the record says."""
    label = f"{name} row {i}"
    if isinstance(record, dict) and isinstance(record.get("shape"), dict):
        s = record["shape"]
        label += " (" + " ".join(f"{k}={s.get(k)}" for k in SHAPE_FIELDS)
        label += ", LoRA" if record.get("lora") else ", LoRA-free"
        c = record.get("lora_class")
        if isinstance(c, dict):  # slots x rank, as LoRAClass prints
            label += f" {c.get('slots')}x{c.get('rank')}"
        t = record.get("tokens")
        if isinstance(t, dict):
            label += f", T {t.get('from')}..{t.get('to') or 'inf'}"
        label += ")"
    return label


def _int(where: str, value: object, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TableError(where, value, f"{what} (an integer >= {minimum})")
    return value


def _pow2(where: str, value: object, what: str) -> int:
    value = _int(where, value, what)
    if value & (value - 1):
        raise TableError(where, value, f"{what} (a power of two)")
    return value


def _object(where: str, value: object, keys: Iterable[str], optional: Iterable[str] = ()):
    keys, optional = set(keys), set(optional)
    if not isinstance(value, dict):
        raise TableError(where, value, f"an object with {sorted(keys)}")
    missing, unknown = keys - set(value), set(value) - keys - optional
    if missing or unknown:
        got = f"missing {sorted(missing)}" if missing else f"unknown {sorted(unknown)}"
        raise TableError(where, got, f"the fields {sorted(keys | optional)}")
    return value


def _tiles(where: str, value: object) -> GemmTiles:
    t = _object(where, value, TILE_FIELDS)
    return GemmTiles(
        _pow2(f"{where}.block_n", t["block_n"], "BLOCK_N"),
        _pow2(f"{where}.block_k", t["block_k"], "BLOCK_K"),
        _pow2(f"{where}.num_warps", t["num_warps"], "warps"),
        _int(f"{where}.num_stages", t["num_stages"], "stages"),
    )


def _knob(where: str, name: str, value: object, lora: bool):
    if name not in KNOBS:
        raise TableError(where, name, f"a TileConfig knob ({', '.join(sorted(KNOBS))})")
    if name in LORA_KNOBS and not lora:
        raise TableError(where, name, "no LoRA knob on a LoRA-free row")
    kind = KNOBS[name]
    if kind is tuple:
        if not (isinstance(value, list) and len(value) == 2):
            raise TableError(f"{where}.{name}", value, "[rows, BLOCK_K], two powers of two")
        return tuple(_pow2(f"{where}.{name}", v, name) for v in value)
    if kind is bool:
        if not isinstance(value, bool):
            raise TableError(f"{where}.{name}", value, "true or false")
        return value
    if name == "half_tail":
        if isinstance(value, bool) or value not in (1, 2, 3):
            raise TableError(f"{where}.{name}", value, "1 (up GEMM), 2 (down GEMM) or 3 (both)")
        return value
    return _pow2(f"{where}.{name}", value, name)


def _tuned(where: str, value: object) -> dict:
    t = _object(where, value, _TUNED_FIELDS)
    for key, kind in _TUNED_FIELDS.items():
        ok = isinstance(t[key], str) if kind is str else isinstance(t[key], (int, float))
        if not ok or isinstance(t[key], bool):
            raise TableError(f"{where}.{key}", t[key], f"a {kind.__name__}")
    _int(f"{where}.tokens", t["tokens"], "the T it was timed at")
    return t


def _lora_class(where: str, value: object, lora: bool) -> LoRAClass:
    if not lora:
        raise TableError(where, value, "no lora_class on a LoRA-free row (remove the field)")
    c = _object(where, value, ("rank", "slots"))
    try:
        return LoRAClass(c["rank"], c["slots"])
    except ConfigError as err:  # a value off its grid: err.key is lora_class.rank / .slots
        field = err.key.rsplit(".", 1)[-1]
        raise TableError(f"{where}.{field}", err.value, f"a {field} class, {err.expected}") from err


def _row(name: str, i: int, record: object) -> TableRow:
    where = _where(name, i, record)
    r = _object(where, record, {"shape", "lora", "tokens", "block_m", "up", "down"}, _ROW_FIELDS)
    s = _object(f"{where}: shape", r["shape"], SHAPE_FIELDS)
    shape = tuple(_int(f"{where}: shape.{k}", s[k], k) for k in SHAPE_FIELDS)
    if not isinstance(r["lora"], bool):
        raise TableError(f"{where}: lora", r["lora"], "true or false")
    t = _object(f"{where}: tokens", r["tokens"], ("from", "to"))
    low = _int(f"{where}: tokens.from", t["from"], "the smallest T it serves")
    high = INF if t["to"] is None else _int(f"{where}: tokens.to", t["to"], "T or null", low)
    knobs = r.get("knobs", {})
    if not isinstance(knobs, dict):
        raise TableError(f"{where}: knobs", knobs, "an object of TileConfig knobs")
    tuned = _tuned(f"{where}: tuned", r["tuned"]) if "tuned" in r else {}
    if not isinstance(r.get("note", ""), str):
        raise TableError(f"{where}: note", r["note"], "a string")
    lora_class = REFERENCE
    if "lora_class" in r:
        lora_class = _lora_class(f"{where}: lora_class", r["lora_class"], r["lora"])
    return TableRow(
        shape=shape,
        lora=r["lora"],
        max_tokens=high,
        block_m=_pow2(f"{where}: block_m", r["block_m"], "BLOCK_M"),
        up=_tiles(f"{where}: up", r["up"]),
        down=_tiles(f"{where}: down", r["down"]),
        knobs={k: _knob(f"{where}: knobs", k, v, r["lora"]) for k, v in knobs.items()},
        tuned_at=tuned.get("tokens"),
        run=tuned.get("run", ""),
        before_ms=tuned.get("before_ms"),
        after_ms=tuned.get("after_ms"),
        note=r.get("note", ""),
        lora_class=lora_class,
        min_tokens=None if lora_class == REFERENCE else low,  # REFERENCE: from the row before
    )


def _check_ranges(name: str, records: list, rows: tuple[TableRow, ...]) -> None:
    """The REFERENCE-class rows of each shape and mode cover T from 1 on, without gap or
    overlap; the rows of each other class do not overlap (they may leave gaps)."""
    last: dict = {}
    for i in sorted(range(len(rows)), key=lambda i: rows[i].order):
        row, low = rows[i], records[i]["tokens"]["from"]
        group = (row.shape, row.lora, row.lora_class)
        previous = last.get(group, 0)
        if row.lora_class == REFERENCE and low != previous + 1:
            raise TableError(
                f"{_where(name, i, records[i])}: tokens.from",
                low,
                f"{previous + 1} (one more than the previous row's tokens.to of this shape and "
                "mode; rows may neither overlap nor leave a gap)",
            )
        if row.lora_class != REFERENCE and low <= previous:
            raise TableError(
                f"{_where(name, i, records[i])}: tokens.from",
                low,
                f"more than {previous} (the previous row's tokens.to of this shape and LoRA "
                f"class {row.lora_class}; rows of a class may leave gaps but not overlap)",
            )
        last[group] = row.max_tokens
