"""The tile config of one forward: the H200 table's row for the shape, mode and T, else
the heuristic (tiling/heuristic.py)."""

from __future__ import annotations

import dataclasses

from .config import TileConfig
from .heuristic import lora_rules, off_table_config
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
) -> TileConfig:
    """Tiles for one forward (`table`: the H200 table unless given). Static per (shape, T):
    a CUDA graph per bucket sees one config. With LoRA, the knobs a row does not set
    come from the rules (heuristic.lora_rules)."""
    row = (H200 if table is None else table).lookup(
        (num_experts, top_k, hidden, inter), lora, num_tokens
    )
    if row is None:
        return off_table_config(num_tokens, num_experts, top_k, lora)
    cfg = row.config()
    if not lora:
        return cfg
    rules = lora_rules(num_tokens, num_experts, top_k)
    return dataclasses.replace(cfg, **{**rules, **row.knobs})
