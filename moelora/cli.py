"""`moelora` command line: a thin dispatcher over moelora/commands/*.

Each subcommand module exposes `add_parser(subparsers)` and `run(args) -> int` (exit code).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .errors import MoeloraError

EXIT_ERROR = 2  # bad usage, configuration or input (plan uses 3 for an oracle refusal)

# Fixed order; a module listed here that is not installed yet is skipped with a clear note.
COMMANDS = ("generate", "demo", "plan", "validate", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moelora", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"moelora.commands.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"moelora.commands.{name}":
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.run(args) or 0)
    except MoeloraError as err:  # a refusal or bad input: the message says what to fix
        print(f"moelora {args.command}: {err}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
