"""`moelora run-batch -i requests.jsonl -o results.jsonl MODEL_DIR`: OpenAI's batch file
format (vLLM's run_batch) through the same scheduler as `moelora serve`; each line names its
adapter in body.model. The output file is checked and emptied before the model loads; each
record is written as its line finishes (moelora.serve.batch_output). A progress bar of finished
lines on stderr. SIGTERM / SIGINT stop the job: the lines written stay, exit 128 + signal."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from ..errors import ConfigError
from ..serve.launch import start
from .serve import add_model_flags

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Lines in flight per engine row: one row's worth runs, one waits in the scheduler's queue so
# a freed row is refilled at the next step (the queue is FIFO: a deeper window changes nothing
# but memory on a long file).
WINDOW_PER_ROW = 2


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run-batch",
        help="run an OpenAI batch file (JSONL, one request per line, body.model = adapter)",
    )
    p.add_argument("model", metavar="MODEL_DIR", help="a transformers model directory")
    p.add_argument("-i", "--input-file", required=True, help="requests, one JSON per line")
    p.add_argument("-o", "--output-file", required=True,
                   help="results, one JSON per line in completion order (match by custom_id)")  # fmt: skip
    p.add_argument("--served-model-name", default=None,
                   help="the base model's name in body.model (default: MODEL_DIR as given)")  # fmt: skip
    add_model_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..serve.launch import _interpret_without_gpu

    _interpret_without_gpu()  # before batch_file's imports reach the kernels
    from tqdm import tqdm

    from ..serve.batch_file import count_lines
    from ..serve.batch_output import ResultFile

    source = Path(args.input_file)
    if not source.is_file():
        raise ConfigError("--input-file", str(source), "an existing JSONL file")
    data = source.read_bytes()
    out = ResultFile.create(Path(args.output_file), source)
    try:
        ctx = start(args)
    except BaseException:
        out.discard()
        raise
    total = count_lines(data)
    try:
        with tqdm(total=total, desc="run-batch", unit="req") as bar:

            def write(record: dict) -> None:
                out.write(record)
                bar.update(1)

            caught = asyncio.run(_run_until_signal(ctx, data, write))
    finally:
        ctx.scheduler.stop(0.0)
        ctx.scheduler.engine.close()
        out.close()
    if caught is not None:
        print(f"moelora run-batch: interrupted by {caught.name}: {out.written} of {total} lines "
              f"written to {out.path}; the lines whose custom_id is missing there did not run",
              file=sys.stderr)  # fmt: skip
        return 128 + caught  # the shell's code for a job ended by that signal
    print(f"moelora run-batch: {out.written - out.failed} done, {out.failed} failed -> "
          f"{out.path}")  # fmt: skip
    return 0


async def _run_until_signal(
    ctx, data: bytes, write: Callable[[dict], None]
) -> signal.Signals | None:
    """Runs the batch with SIGTERM / SIGINT handlers installed for its duration (the previous
    ones restored after); the first of them stops it. The signal caught, or None."""
    from ..serve.batch_file import parse_lines, run_lines

    loop, main = asyncio.get_running_loop(), asyncio.current_task()
    caught: list[signal.Signals] = []

    def stop(sig: signal.Signals) -> None:
        if not caught:  # a second signal while the running lines are cancelled changes nothing
            caught.append(sig)
            main.cancel()

    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop, sig)
    try:
        window = WINDOW_PER_ROW * ctx.scheduler.engine.max_rows
        await run_lines(ctx, parse_lines(data), write, window)
    except asyncio.CancelledError:
        if not caught:
            raise
    finally:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            if handler is not None:  # None: a handler not set from Python, left as it is
                signal.signal(sig, handler)
    return caught[0] if caught else None
