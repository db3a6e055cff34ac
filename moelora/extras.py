"""The optional extras of pyproject.toml that commands import, and the error naming the one to
install when one of their packages is missing.

The core install (torch, triton, numpy) runs `plan`, `presets`, `validate` and `bench`, and
every command's --help; `generate`, `demo` and `bench --model-level` need the `hf` extra
(transformers, PEFT, safetensors: they write and read PEFT adapter files), `serve` and `run-batch` the `serve`
extra, `serve --ray-replicas` (moelora.serve.ray) the `ray` extra; a served request's
response_format needs the `structured` extra (xgrammar: without it the server answers such
a request with a 400 naming the package and runs everything else). Those commands import
the packages when they run, never while the parser is built; cli.py turns the
ModuleNotFoundError of a missing one into `missing_extra`'s ConfigError (exit 2, one line).
tests/test_core_install.py runs the CLI in a venv with the core requirements only, and
checks this table against pyproject.toml.
"""

from __future__ import annotations

from .errors import ConfigError

# Import name -> the smallest extra of pyproject.toml that installs it.
EXTRA_OF = {
    "transformers": "hf",
    "peft": "hf",
    "safetensors": "hf",
    "fastapi": "serve",
    "uvicorn": "serve",
    "tqdm": "serve",
    "ray": "ray",
    "xgrammar": "structured",
    "matplotlib": "bench",
}


def missing_extra(err: ModuleNotFoundError) -> ConfigError | None:
    """The error to print for `err` when the missing module is one of an extra's packages
    (the package itself: a submodule missing from an installed package is another fault),
    else None."""
    extra = EXTRA_OF.get(err.name or "")
    if extra is None:
        return None
    return ConfigError(
        "package", err.name, f"installed (the {extra} extra)", f"pip install 'moelora[{extra}]'"
    )
