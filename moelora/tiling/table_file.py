"""Writing the tile table file (tiling/h200_table.json): the text `load_table`
(tiling/table.py) reads back unchanged, one record per row in the table's order."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from .lora_class import REFERENCE, LoRAClass
from .table import FORMAT, INF, SHAPE_FIELDS, TILE_FIELDS, TableRow


def lows(rows: Iterable[TableRow]) -> dict[tuple, int]:
    """Each row's tokens.from, by key: a REFERENCE-class row serves the T above the
    previous row of its shape and mode, a row of another class from its min_tokens."""
    out, last = {}, {}
    for row in sorted(rows, key=lambda r: r.order):
        if row.lora_class == REFERENCE:
            out[row.key] = last.get((row.shape, row.lora), 0) + 1
            last[(row.shape, row.lora)] = row.max_tokens
        else:
            out[row.key] = row.min_tokens
    return out


def _class_record(lora_class: LoRAClass) -> dict:
    return {"rank": lora_class.rank, "slots": lora_class.slots}


def _record(row: TableRow, low: int) -> dict:
    """The JSON record of `row`, serving T from `low`."""
    tiles = lambda g: {k: getattr(g, k) for k in TILE_FIELDS}  # noqa: E731
    record: dict = {
        "shape": dict(zip(SHAPE_FIELDS, row.shape)),
        "lora": row.lora,
        **({} if row.lora_class == REFERENCE else {"lora_class": _class_record(row.lora_class)}),
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
    """The file text of a table: a header, then one record per line (TableRow.order: by
    shape, LoRA-free rows first, then by class and T), a REFERENCE-class row's tokens.from
    following the row before it, another class's row's its own (`lows`)."""
    rows = sorted(rows, key=lambda r: r.order)
    low = lows(rows)
    lines = ["  " + json.dumps(_record(row, low[row.key])) for row in rows]
    head = json.dumps({"format": FORMAT, "last_run": last_run}, indent=1)[:-2]
    return head + ',\n "rows": [\n' + ",\n".join(lines) + "\n ]\n}\n"


def write_table(path: str | Path, rows: Iterable[TableRow], last_run: dict) -> None:
    """Write `rows` as a table file that load_table reads back unchanged. Written beside
    and renamed over it: a tune killed at its time limit leaves the previous file whole
    (scripts/gpu_lora_tune.sh starts the next tune from it)."""
    path = Path(path)
    part = path.with_name(path.name + ".part")
    part.write_text(table_json(rows, last_run))
    part.replace(path)
