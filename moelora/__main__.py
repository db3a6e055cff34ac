"""`python -m moelora` and the `moelora` command: the command line, with Ctrl-C answered by
one line and exit code 130 also while the package itself is still being imported (cli.main
answers it once it runs)."""

import sys


def run() -> int:
    from .interrupt import install

    install()  # Ctrl-C while the command loads: one line, 130, at once (interrupt.py)
    try:
        from .cli import main

        return main()
    except KeyboardInterrupt:
        print("moelora: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(run())
