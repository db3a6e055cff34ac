"""`moelora` command line: a thin dispatcher over the commands of moelora/commands/.

Each subcommand module exposes `add_parser(subparsers)` and `run(args) -> int` (exit code).
Exit codes mean the same in every command (moelora.errors, docs/plan.md).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from . import __version__
from .commands.flag_terms import error_text
from .errors import EXIT_INTERRUPTED, EXIT_USAGE, MoeloraError, exit_code
from .extras import missing_extra
from .interrupt import command_parsed

DESCRIPTION = (
    "moelora runs the expert layers of Mixture-of-Experts models with many LoRA adapters in "
    "one batch (each token its own adapter, or the base model). The main job is `generate`: "
    "a transformers model generating one batch whose rows each use their own PEFT adapter, "
    "checked row by row against HF + PEFT (a random model and adapters by default; CPU when "
    "there is no GPU). Before loading any weight, `plan` says whether a deployment will run "
    "and on which backend; `demo` runs one layer end to end; `presets` lists the models it "
    "knows; `validate` and `bench` check and time the fast backends on your GPU."
)
EPILOG = (
    "exit codes (every command): 0 done or accepted; 1 a result differed from the reference; "
    "2 bad usage or configuration (nothing ran); 3 refused by the backend oracle (the message "
    "names each failing capability and the nearest deployment that runs); 130 interrupted "
    "(Ctrl-C). Start with: moelora generate"
)

# Fixed order; a module listed here that is not installed yet is skipped with a clear note.
COMMANDS = ("generate", "serve", "run_batch", "demo", "plan", "validate", "bench", "presets")
# Commands whose --json promises one JSON document on stdout, usage errors included.
JSON_COMMANDS = ("plan",)


class UsageExit(SystemExit):
    """argparse's usage error (exit 2), carrying its message and the command it belongs to."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(EXIT_USAGE)
        self.command = prog.split()[-1] if " " in prog else None
        self.message = f"{prog}: error: {message}"


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # as argparse prints it, then an exception to catch
        self.print_usage(sys.stderr)
        exit_ = UsageExit(self.prog, message)
        print(exit_.message, file=sys.stderr)
        raise exit_


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="moelora", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"moelora {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"moelora.commands.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"moelora.commands.{name}":
                raise
            continue
        module.add_parser(sub)
    for command in sub.choices.values():  # the flags a refusal's fix may tell its user to pass:
        shown = [a for a in command._actions if a.help is not argparse.SUPPRESS]  # its --help's
        command.set_defaults(command_flags=frozenset(f for a in shown for f in a.option_strings))
    return parser


# commands whose startup only loads (a model, adapters) before a server or batch loop that
# installs its own Ctrl-C handler: until then Ctrl-C exits at once (interrupt.py)
LOADS_FIRST = frozenset({"serve", "run-batch"})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = None
    try:
        args = _parse(argv)
        command = args.command
        command_parsed(command, loads_only=command in LOADS_FIRST)
        return _run(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback; 130 as the shell says it
        print(
            f"moelora {command}: interrupted" if command else "moelora: interrupted",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED


def _parse(argv: list[str]) -> argparse.Namespace:
    try:
        return build_parser().parse_args(argv)
    except UsageExit as exit_:
        if exit_.command in JSON_COMMANDS and "--json" in argv:  # machines get an answer too
            error = {"accepted": False, "verdict": "ERROR", "exit_code": EXIT_USAGE}
            print(json.dumps(error | {"error": exit_.message}, indent=2))
        raise


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    # Each command prints the selection itself, once; -v adds the oracle's log line.
    logging.getLogger("moelora.oracle").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    try:
        return int(args.run(args) or 0)
    except MoeloraError as err:  # a refusal (3) or bad input (2): the message says what to fix
        return _error(args, err)
    except ModuleNotFoundError as err:  # an extra this command needs is not installed
        missing = missing_extra(err)
        if missing is None:
            raise
        return _error(args, missing)


def _error(args: argparse.Namespace, err: MoeloraError) -> int:
    message = error_text(err, args.command_flags, getattr(args, "flag_terms", {}))
    print(f"moelora {args.command}: {message}", file=sys.stderr)
    return exit_code(err)


if __name__ == "__main__":
    sys.exit(main())
