"""`moelora presets`: the model presets `--model` accepts, with their MoE shapes."""

from __future__ import annotations

import argparse

from ..deployment import dtype_name
from ..presets import PRESETS, load_preset

COLUMNS = ("preset", "model_type", "E", "K", "H", "I", "activation", "routing", "bias", "dtype",
           "MoE layers")  # fmt: skip


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "presets",
        help="list the model presets (--model NAME) with their MoE shapes",
        description="The model presets that --model accepts (besides a config.json path or a "
        "model directory): E experts, K top-k, H hidden size, I expert intermediate size.",
    )
    p.set_defaults(run=run)


def rows() -> list[list[str]]:
    table = []
    for name in PRESETS:
        model = load_preset(name)
        s = model.shape
        table.append(
            [
                name,
                model.model_type,
                str(s.num_experts),
                str(s.top_k),
                str(s.hidden_size),
                str(s.intermediate_size),
                s.activation.value,
                model.routing.method.value,
                "yes" if s.has_bias else "no",
                dtype_name(s.dtype),
                f"{len(model.moe_layers)}/{model.num_layers}",
            ]
        )
    return table


def run(args: argparse.Namespace) -> int:
    table = [list(COLUMNS), *rows()]
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0
