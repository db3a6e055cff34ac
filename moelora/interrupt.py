"""Ctrl-C before a command has anything to keep: one line and exit code 130 at once.

`python -m moelora` (and the `moelora` command) installs `exit_now` as the SIGINT handler
before anything heavy is imported. A KeyboardInterrupt raised during the imports and the
model load could be swallowed (raised inside a finalizer, it is printed and ignored, and
the load went on: a server that ignored Ctrl-C) or be followed by CPython's own exit by
signal or an abort in a library's thread teardown (exit -2 or -6 after the one line), at
moments no test could pin down. The handler writes the line and leaves with os._exit(130):
no finalizer runs, nothing is lost (nothing has been written yet). Once the command is
parsed, cli.main hands Ctrl-C back to Python's KeyboardInterrupt for every command but
those whose startup only loads (serve and run-batch: their server or batch loop installs
its own handler when it starts).
"""

from __future__ import annotations

import os
import signal
import sys

_label = ["moelora"]  # what the line names: the program, then its command


def exit_now(signum, frame) -> None:
    """The SIGINT handler: one line on stderr, exit code 130, no cleanup."""
    try:
        sys.stdout.flush()
        sys.stderr.write(f"{_label[0]}: interrupted\n")
        sys.stderr.flush()
    finally:
        os._exit(130)


def install() -> None:
    """exit_now for SIGINT (the process's entry point only; never inside a test process)."""
    signal.signal(signal.SIGINT, exit_now)


def command_parsed(command: str, loads_only: bool) -> None:
    """The command is known: name it in the line; keep exiting at once while it only
    loads (loads_only), else give Ctrl-C back to KeyboardInterrupt (its cleanup runs).
    Does nothing where install() did not run (cli.main called inside another program)."""
    if signal.getsignal(signal.SIGINT) is not exit_now:
        return
    _label[0] = f"moelora {command}"
    if not loads_only:
        signal.signal(signal.SIGINT, signal.default_int_handler)
