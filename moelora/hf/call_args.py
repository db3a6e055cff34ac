"""What a handle call's arguments say: its rows and tokens per row, one adapter name per row
(None and PEFT's "__base__" both mean the base model), and the rows generate makes of each
input row (beams, returned sequences)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import InputError
from ..lora.rows import BASE


def rows_of(input_ids: torch.Tensor | None, kwargs: dict[str, Any]) -> tuple[int, int]:
    """(B, S) of the call's input."""
    source = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
    if source is None or source.dim() < 2:
        raise InputError("input_ids", None if source is None else f"shape {list(source.shape)}",
                         "a [B, S] tensor of token ids (or inputs_embeds [B, S, H])")  # fmt: skip
    return source.shape[0], source.shape[1]


def row_names(adapter_names: Sequence[str | None] | None, rows: int) -> list[str | None]:
    if adapter_names is None:
        return [None] * rows
    if isinstance(adapter_names, str) or not isinstance(adapter_names, Sequence):
        raise InputError(
            "adapter_names", repr(adapter_names), f"a list of {rows} names (None = base model)"
        )
    if len(adapter_names) != rows:
        raise InputError("adapter_names", f"{len(adapter_names)} names",
                         f"one per row of input_ids ({rows} rows; None = the base model)")  # fmt: skip
    return [None if n in (None, BASE) else n for n in adapter_names]


def expand_factor(model: nn.Module, kwargs: dict[str, Any]) -> int:
    """Rows generate makes of each input row: max(num_beams, num_return_sequences)."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    beams = kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1
    returns = kwargs.get("num_return_sequences", getattr(config, "num_return_sequences", 1)) or 1
    return max(int(beams), int(returns))
