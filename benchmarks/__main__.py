"""`python -m benchmarks [NAME [ARGS ...]]`: the one runner of benchmarks/. Without a name,
the registered tools (registry.py) and what each needs; with one, that tool's main() with
ARGS as its command line (`python -m benchmarks tune --help`)."""

from __future__ import annotations

import importlib
import sys

from .registry import TOOLS


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "list"):
        print("usage: python -m benchmarks [NAME [ARGS ...]]  (NAME --help: its options)\n")
        width = max(map(len, TOOLS))
        for tool in TOOLS.values():
            print(
                f"{tool.name:<{width}}  {tool.kind.value:<6}  {tool.needs.value:<13}  {tool.summary}"
            )
        if argv and argv[0] != "list":
            raise SystemExit(0)  # as argparse's --help
        return 0
    name, args = argv[0], argv[1:]
    if name not in TOOLS:
        print(f"benchmarks: no tool {name!r}; the tools: {', '.join(TOOLS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.{name}")
    sys.argv = [f"python -m benchmarks {name}", *args]
    code = module.main()  # an exit code, or what a tool returns to its tests (its rows)
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    raise SystemExit(main())
