"""`moelora run-batch -i requests.jsonl -o results.jsonl MODEL_DIR`: OpenAI's batch file
format (vLLM's run_batch) through the same scheduler as `moelora serve`; each line names its
adapter in body.model. A progress bar on stderr; a failed line gets an error record."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from ..errors import ConfigError
from ..serve.launch import start
from .serve import add_model_flags


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run-batch",
        help="run an OpenAI batch file (JSONL, one request per line, body.model = adapter)",
    )
    p.add_argument("model", metavar="MODEL_DIR", help="a transformers model directory")
    p.add_argument("-i", "--input-file", required=True, help="requests, one JSON per line")
    p.add_argument("-o", "--output-file", required=True, help="results, one JSON per line")
    p.add_argument("--served-model-name", default=None,
                   help="the base model's name in body.model (default: MODEL_DIR as given)")  # fmt: skip
    add_model_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..serve.batch_file import lines_of, run_lines

    source = Path(args.input_file)
    if not source.is_file():
        raise ConfigError("--input-file", str(source), "an existing JSONL file")
    lines = source.read_text().splitlines()
    ctx = start(args)
    try:
        with tqdm(total=len(lines_of(lines)), desc="run-batch", unit="req") as bar:
            records = asyncio.run(run_lines(ctx, lines, lambda: bar.update(1)))
    finally:
        ctx.scheduler.stop(0.0)
        ctx.scheduler.engine.close()
    Path(args.output_file).write_text("".join(json.dumps(r) + "\n" for r in records))
    failed = sum(r["error"] is not None for r in records)
    print(f"moelora run-batch: {len(records) - failed} done, {failed} failed -> "
          f"{args.output_file}")  # fmt: skip
    return 0
