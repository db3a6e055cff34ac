"""CLI subcommands: each command is a module (`presets.py`) or, where it has parts, a package
whose `__init__.py` is the command (`generate/`, `plan/`, `validate/`); either exposes
add_parser(subparsers) and run(args) -> int. The modules beside them (flag_terms, flag_types,
case_backend, cpu_cost) serve several commands."""
