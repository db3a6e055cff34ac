"""The H200 tile table as data: one JSON record per row (tiling/h200_table.json).

benchmarks/tune.py writes the file on the GPU (`write_table`); `load_table` reads it
back and checks every record, so a malformed file fails at import with a `TableError`
that names the file, the row and the field. A row serves one model shape (E, K, H, I)
and mode (LoRA or not) for the tokens T in [tokens.from, tokens.to] (to null: no upper
bound); the rows of one shape and mode tile T from 1 without gaps.

Record fields: shape {experts, top_k, hidden, intermediate}, lora, tokens {from, to},
block_m, up / down {block_n, block_k, num_warps, num_stages}, knobs (TileConfig fields,
only those the tune set), tuned {tokens, run, before_ms, after_ms} (the T it was timed
at, the commit of that run, the starting and the chosen config's ms), note.
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

FORMAT = 1
INF = 2**31 - 1  # the upper T bound of a row whose tokens.to is null
H200_TABLE_FILE = "h200_table.json"

_ROW_FIELDS = {"shape", "lora", "tokens", "block_m", "up", "down", "knobs", "tuned", "note"}
_SHAPE_FIELDS = ("experts", "top_k", "hidden", "intermediate")
_TILE_FIELDS = ("block_n", "block_k", "num_warps", "num_stages")
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

    @property
    def key(self) -> tuple[int, int, int, int, bool, int]:
        """(E, K, H, I, LoRA on, T upper bound): the row's place in the table."""
        return (*self.shape, self.lora, self.max_tokens)

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
    """The rows of a tile table file, looked up by shape, mode and T."""

    rows: tuple[TableRow, ...]
    last_run: dict = field(default_factory=dict)  # device, versions and commit of the last tune
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict = {}
        for row in sorted(self.rows, key=lambda r: r.key):
            index.setdefault((row.shape, row.lora), []).append(row)
        object.__setattr__(self, "_index", index)

    def lookup(self, shape: tuple[int, int, int, int], lora: bool, tokens: int) -> TableRow | None:
        """The row serving T = tokens for this shape and mode, else None."""
        rows = self._index.get((shape, lora), [])
        i = bisect.bisect_left([r.max_tokens for r in rows], tokens)
        return rows[i] if i < len(rows) else None

    def by_key(self) -> dict[tuple, TableRow]:
        return {row.key: row for row in self.rows}


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
        label += " (" + " ".join(f"{k}={s.get(k)}" for k in _SHAPE_FIELDS)
        label += ", LoRA" if record.get("lora") else ", LoRA-free"
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
    t = _object(where, value, _TILE_FIELDS)
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


def _row(name: str, i: int, record: object) -> TableRow:
    where = _where(name, i, record)
    r = _object(where, record, {"shape", "lora", "tokens", "block_m", "up", "down"}, _ROW_FIELDS)
    s = _object(f"{where}: shape", r["shape"], _SHAPE_FIELDS)
    shape = tuple(_int(f"{where}: shape.{k}", s[k], k) for k in _SHAPE_FIELDS)
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
    )


def _check_ranges(name: str, records: list, rows: tuple[TableRow, ...]) -> None:
    """The rows of each shape and mode cover T from 1 on, without gap or overlap."""
    last: dict = {}
    order = sorted(range(len(rows)), key=lambda i: rows[i].key)
    for i in order:
        row, low = rows[i], records[i]["tokens"]["from"]
        want = last.get((row.shape, row.lora), 0) + 1
        if low != want:
            raise TableError(
                f"{_where(name, i, records[i])}: tokens.from",
                low,
                f"{want} (one more than the previous row's tokens.to of this shape and mode; "
                "rows may neither overlap nor leave a gap)",
            )
        last[(row.shape, row.lora)] = row.max_tokens


def _record(row: TableRow, low: int) -> dict:
    """The JSON record of `row`, serving T from `low`."""
    tiles = lambda g: {k: getattr(g, k) for k in _TILE_FIELDS}  # noqa: E731
    record: dict = {
        "shape": dict(zip(_SHAPE_FIELDS, row.shape)),
        "lora": row.lora,
        "tokens": {"from": low, "to": None if row.max_tokens == INF else row.max_tokens},
        "block_m": row.block_m,
        "up": tiles(row.up),
        "down": tiles(row.down),
        "knobs": {k: list(v) if isinstance(v, tuple) else v for k, v in row.knobs.items()},
    }
    if row.tuned_at is not None:
        record["tuned"] = {
            "tokens": row.tuned_at,
            "run": row.run,
            "before_ms": round(row.before_ms, 4),
            "after_ms": round(row.after_ms, 4),
        }
    if row.note:
        record["note"] = row.note
    return record


def table_json(rows: Iterable[TableRow], last_run: dict) -> str:
    """The file text of a table: a header, then one record per line (by shape, LoRA-free
    rows first, then by T), each row's tokens.from following the row before it."""
    rows = sorted(rows, key=lambda r: r.key)
    lines, last = [], {}
    for row in rows:
        low = last.get((row.shape, row.lora), 0) + 1
        last[(row.shape, row.lora)] = row.max_tokens
        lines.append("  " + json.dumps(_record(row, low)))
    head = json.dumps({"format": FORMAT, "last_run": last_run}, indent=1)[:-2]
    return head + ',\n "rows": [\n' + ",\n".join(lines) + "\n ]\n}\n"


def write_table(path: str | Path, rows: Iterable[TableRow], last_run: dict) -> None:
    """Write `rows` as a table file that load_table reads back unchanged."""
    Path(path).write_text(table_json(rows, last_run))
