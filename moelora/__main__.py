"""`python -m moelora` and the `moelora` command: the command line, with Ctrl-C answered by
one line and exit code 130 also while the package itself is still being imported (cli.main
answers it once it runs)."""

import sys


def run() -> int:
    try:
        from .cli import main

        return main()
    except KeyboardInterrupt:
        print("moelora: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(run())
