"""The tile config of one forward: the H200 table's row for the shape, mode, LoRA class and
T, else the heuristic (tiling/heuristic.py)."""

from __future__ import annotations

import dataclasses

from .config import TileConfig
from .heuristic import lora_rules, off_table_config
from .lora_class import LoRAClass
from .table import Table, load_table

H200 = load_table()  # the packaged table (tiling/h200_table.json)


def pick_config(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    lora: bool = False,
    table: Table | None = None,
    rank: int = 0,
    slots: int = 0,
) -> TileConfig:
    """Tiles for one forward (`table`: the H200 table unless given). Static per (shape, T,
    bank class): a CUDA graph per bucket sees one config. With LoRA, rank and slots are
    the bank's tile rank and slot count (0: the REFERENCE class the table was first tuned
    at, 8 adapters of rank 16), rounded to their LoRA class (tiling/lora_class.py); a class
    the table lacks at this T takes its nearest tuned neighbour's row (Table.lookup), which
    the backend then fits to this rank's shared memory (tiling/fit.py): an untuned class's
    heuristic is its neighbours' tiles. With LoRA, the knobs a row does not set come from
    the rules (heuristic.lora_rules). A shape without rows takes the heuristic."""
    lora_class = LoRAClass.of(rank, slots) if lora else None
    row = (H200 if table is None else table).lookup(
        (num_experts, top_k, hidden, inter), lora, num_tokens, lora_class
    )
    if row is None:
        return off_table_config(num_tokens, num_experts, top_k, lora)
    cfg = row.config()
    if not lora:
        return cfg
    rules = lora_rules(num_tokens, num_experts, top_k)
    return dataclasses.replace(cfg, **{**rules, **row.knobs})
