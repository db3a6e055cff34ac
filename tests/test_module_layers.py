"""The import directions ARCHITECTURE.md states, read from the source (no import runs):
every import of moelora points up the file's tiers, and neither the package nor benchmarks/
has an import circle; kernels hold no policy (they never import the tile table, the pick,
the fit, a backend or the oracle), tiling/ knows nothing of the kernels, the installed
package never imports the developer's benchmarks/, which never imports the CLI; one
hardware probe and one reading of TRITON_INTERPRET (moelora/device.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "moelora"


def _imports(path: Path) -> set[str]:
    """Absolute names of the modules `path` imports at run time. Left out: imports under
    `if TYPE_CHECKING:` (annotations only) and under `except ImportError:` (the fallback of
    a tool that also runs on a tree from before this layout, as ab_trees and launch_diff
    do for the A/B against 5b4b1d5)."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if (isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
        or (isinstance(node, ast.ExceptHandler) and ast.unparse(node.type or node) == "ImportError")
        for n in ast.walk(node)
    }
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the file's package, level - 1 up
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(parts + ([node.module] if node.module else []))
            else:
                module = node.module
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


# (folder, module prefixes it must not import, why)
RULES = [
    (PACKAGE / "kernels", ("moelora.tiling.pick", "moelora.tiling.fit", "moelora.tiling.table",
                           "moelora.tiling.heuristic", "moelora.backends", "moelora.oracle",
                           "moelora.layer", "moelora.parallel", "moelora.commands",
                           "moelora.bench"), "kernels hold no policy"),
    (PACKAGE / "tiling", ("moelora.kernels", "moelora.backends", "moelora.oracle",
                          "moelora.commands", "triton"), "tiling/ sits below the kernels"),
    (PACKAGE, ("benchmarks",), "the package installs without benchmarks/"),
    (PACKAGE / "bench", ("moelora.commands", "moelora.oracle"), "the CLI imports bench/"),
    (ROOT / "benchmarks", ("moelora.commands",), "developer tools import the package, not the CLI"),
]  # fmt: skip


@pytest.mark.parametrize("folder,banned,why", RULES, ids=[r[2] for r in RULES])
def test_import_directions(folder: Path, banned: tuple, why: str) -> None:
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _files(folder)
        for name in _imports(path)
        if any(name == b or name.startswith(b + ".") for b in banned)
    ]
    assert not bad, f"{why}: {bad}"


PROBES = re.compile(
    r"get_device_capability\(|get_device_properties\(|torch\.version\.hip"
    r"|environ\.get\(\s*\"TRITON_INTERPRET"
)


def test_one_hardware_probe_and_one_interpreter_check() -> None:
    found = [
        str(path.relative_to(ROOT))
        for path in _files(PACKAGE)
        if PROBES.search(path.read_text()) and path.name != "device.py"
    ]
    assert not found, f"probe the GPU or read TRITON_INTERPRET in moelora/device.py only: {found}"


@pytest.mark.parametrize(
    "value", ["1", "0", "", "true", "TRUE", "on", "yes", "y", "2", "off", " 1"]
)
def test_the_interpreter_check_reads_the_variable_as_triton_does(monkeypatch, value) -> None:
    """moelora's check agrees with Triton's own reading (triton.knobs), so a value one
    counts and the other not (as `true` once was) cannot split the code paths."""
    knobs = pytest.importorskip("triton.knobs")
    from moelora.device import triton_interpreted

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_interpreted() == bool(knobs.runtime.interpret), value
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not triton_interpreted() and not knobs.runtime.interpret


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


# The tree the layer rules speak of: the package and the developer's tools beside it.
MODULES = {_module(p): p for folder in (PACKAGE, ROOT / "benchmarks") for p in _files(folder)}


def _targets(path: Path) -> set[str]:
    """The modules of MODULES that `path` names in any import statement: at run time, for
    annotations only (a module named in an annotation must sit below its user as much as
    one imported to run), inside functions, in fallbacks. `from a import b` names a.b where
    that is a module, else a (the package's __init__, a re-export)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:  # relative: from the file's package, level - 1 up
                parts = [*package[: len(package) - node.level + 1], node.module or ""]
                base = ".".join(parts).strip(".")
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                      for a in node.names}  # fmt: skip
    return (found & MODULES.keys()) - {_module(path)}


TIER_NAME = re.compile(r"\*\*`([\w./]+)`\*\*")


def _dotted(name: str) -> str:
    """ARCHITECTURE.md's file name as a module: `quant/` moelora.quant, `__init__.py` the
    package itself, `benchmarks/` (outside the package) benchmarks."""
    if name == "__init__.py":
        return "moelora"
    stem = name.removesuffix("/").removesuffix(".py").replace("/", ".")
    return f"moelora.{stem}" if (PACKAGE / name).exists() else stem


def _tiers() -> list[tuple[str, ...]]:
    """ARCHITECTURE.md's layers, top first: each paragraph that opens with a bold file name
    (**`errors.py`**, **`quant/`**) is one tier, holding every bold file name in it."""
    paragraphs = (ROOT / "ARCHITECTURE.md").read_text().split("\n\n")
    return [tuple(TIER_NAME.findall(p)) for p in paragraphs if p.startswith("**`")]


TIERS = {_dotted(name): i for i, tier in enumerate(_tiers()) for name in tier}


def _tier(module: str) -> int | None:
    """The tier of the longest ARCHITECTURE.md name that is `module` or holds it."""
    names = [n for n in TIERS if module == n or module.startswith(n + ".")]
    return TIERS[max(names, key=len)] if names else None


def test_architecture_places_every_module() -> None:
    """Every bold file name of ARCHITECTURE.md is a file or folder of the tree, and every
    module of the package and of benchmarks/ falls in one of its tiers."""
    names = [name for tier in _tiers() for name in tier]
    missing = [n for n in names if not (PACKAGE / n).exists() and not (ROOT / n).exists()]
    assert not missing, f"ARCHITECTURE.md names files that do not exist: {missing}"
    unplaced = sorted(m for m in MODULES if _tier(m) is None)
    assert not unplaced, f"give these a paragraph (a tier) in ARCHITECTURE.md: {unplaced}"


def _upward_imports() -> list[str]:
    tiers = [tier[0] for tier in _tiers()]  # each named by its paragraph's first file
    return [
        f"{m} (tier of {tiers[_tier(m)]}) imports {t} (tier of {tiers[_tier(t)]}, below it)"
        for m, path in sorted(MODULES.items())
        for t in sorted(_targets(path))
        if _tier(m) is not None and _tier(t) is not None and _tier(t) > _tier(m)
    ]


def test_imports_point_up_the_architecture() -> None:
    """A module imports only the modules of its own tier of ARCHITECTURE.md and of the tiers
    above it: quantization.py's formats sit at the config tier (config, weights and the
    deployment hold them), the model-level run has a tier of its own below truth/ (the rest
    of bench/ sits above hf/), extras.py sits below serve/ (which reads it), and so on down
    the file."""
    bad = _upward_imports()
    assert not bad, "move the import or the module, or fix ARCHITECTURE.md: " + "; ".join(bad)


def _import_cycles() -> list[set[str]]:
    """The import circles of the package and benchmarks/ (every import statement, package
    __init__ files included), each as the set of its modules."""
    graph = {m: _targets(path) for m, path in MODULES.items()}
    reach = {}
    for start in graph:  # the modules each one reaches
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph[m]
        reach[start] = seen
    cycles = {
        frozenset({m} | {n for n in reach[m] if m in reach[n]}) for m in graph if m in reach[m]
    }
    return sorted((set(c) for c in cycles), key=sorted)


def test_no_import_circles() -> None:
    """LoRAComm lives in comm.py, below every user, so parallel.py (which implements it and
    imports the layer) is imported by nothing below it, not even for annotations; the HF
    key table returns plain values, so config.py imports it and not the other way;
    benchmarks/fp8_model.py holds what both FP8 phases time, so fp8_generate.py imports it
    and not the other way."""
    assert _import_cycles() == []


def test_serving_sits_on_top() -> None:
    """Only the commands import serve/; serve/ never imports the commands; only serve/app.py
    and serve/launch.py (which starts it) import the HTTP stack (the `serve` extra)."""
    serve, commands = PACKAGE / "serve", PACKAGE / "commands"
    bad = []
    for path in _files(PACKAGE):
        names = _imports(path)
        inside_serve = serve in path.parents
        if not inside_serve and commands not in path.parents:
            bad += [
                f"{path.relative_to(ROOT)} imports {n}"
                for n in names
                if n.startswith("moelora.serve")
            ]
        if inside_serve:
            bad += [
                f"{path.relative_to(ROOT)} imports {n}"
                for n in names
                if n.startswith("moelora.commands")
            ]
        http = [n for n in names if n.split(".")[0] in ("fastapi", "starlette", "uvicorn")]
        if http and path not in (serve / "app.py", serve / "launch.py", serve / "limits.py"):
            bad.append(f"{path.relative_to(ROOT)} imports {http}")
    assert not bad, bad
