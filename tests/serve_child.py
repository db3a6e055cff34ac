"""`python tests/serve_child.py ARGV...`: `moelora ARGV` (serve or run-batch) in a child
process, with the engine double (serve_engine_double) while moelora.hf.engine is absent."""

from __future__ import annotations

import sys

import serve_engine_double

if __name__ == "__main__":
    serve_engine_double.install()
    from moelora.cli import main

    sys.exit(main(sys.argv[1:]))
