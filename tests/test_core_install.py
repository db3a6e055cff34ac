"""The core install runs the command line (issue 34): `pip install .` brings torch, triton
and numpy only (pyproject.toml's dependencies), and `moelora --version`, `plan`, `presets`
and every command's --help must run there; a command that needs an extra (generate and
demo: hf; serve and run-batch: serve) exits 2 with one line naming the extra, never a
traceback. The venv holds the wheel of this tree and links to the distributions of the
core requirements' closure only (tests/venvs.py), so transformers, PEFT, safetensors,
FastAPI... are missing there as they are for a user."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name
from venvs import (
    build_wheel,
    clean_env,
    closure,
    fresh_venv,
    link_distributions,
    wheel_requirements,
)

from moelora import __version__
from moelora.extras import EXTRA_OF

HF = "Fix: pip install 'moelora[hf]'"
SERVE = "Fix: pip install 'moelora[serve]'"

# (id, argv, exit code, words on stdout, the one line on stderr (None: stderr empty));
# MODEL_DIR stands for an empty directory, INPUT for an existing batch file.
CASES = [
    ("version", ["--version"], 0, [f"moelora {__version__}"], None),
    ("plan", ["plan", "--model", "qwen3-30b-a3b", "--device", "h200"], 0,
     ["verdict: ACCEPTED: triton"], None),
    ("presets", ["presets"], 0, ["qwen3-30b-a3b", "mixtral-8x7b"], None),
    ("bench-help", ["bench", "--help"], 0, ["--suite", "--iters", "--model-level"], None),
    # the model-level run builds a transformers model and PEFT adapters
    ("bench-model-level", ["bench", "--model-level", "--small", "--device", "cpu"], 2, [],
     f"moelora bench: config key 'package' = 'transformers': expected installed (the hf "
     f"extra). {HF}"),
    ("validate-help", ["validate", "--help"], 0, ["--suite", "--quick"], None),
    # the commands that need an extra name it, when run (their --help runs: below)
    ("generate", ["generate"], 2, [],
     f"moelora generate: config key 'package' = 'transformers': expected installed (the hf "
     f"extra). {HF}"),
    # the demo writes its adapters as PEFT files (safetensors) and loads them back
    ("demo", ["demo"], 2, [], "moelora demo: "),
    ("serve", ["serve", "MODEL_DIR"], 2, [], "moelora serve: "),
    ("run-batch", ["run-batch", "MODEL_DIR", "-i", "INPUT", "-o", "OUTPUT"], 2, [],
     "moelora run-batch: "),
]  # fmt: skip
FIXES = {"demo": HF, "serve": SERVE, "run-batch": SERVE}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def core(wheel: Path, tmp_path_factory) -> Path:
    """The bin folder of a venv with the wheel and the core requirements' closure only."""
    tmp = tmp_path_factory.mktemp("core")
    requirements = wheel_requirements(wheel)
    names = {canonicalize_name(r.name) for r in requirements}
    assert names == {"torch", "triton", "numpy"}, names  # what `pip install .` brings
    deps = link_distributions(closure(requirements), tmp / "core-deps")
    return fresh_venv(tmp, wheel, deps)


@pytest.fixture(scope="module")
def ran(core: Path, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Each case's `moelora ARGV` in the core venv, two at a time (each imports torch)."""
    work = tmp_path_factory.mktemp("work")
    (work / "model").mkdir()
    (work / "in.jsonl").write_text("")
    paths = {"MODEL_DIR": work / "model", "INPUT": work / "in.jsonl", "OUTPUT": work / "o.jsonl"}

    def one(argv: list[str]) -> subprocess.CompletedProcess:
        argv = [str(paths.get(a, a)) for a in argv]
        return subprocess.run([core / "moelora", *argv], cwd=work, env=clean_env(),
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    with ThreadPoolExecutor(max_workers=2) as pool:
        done = pool.map(one, [argv for _, argv, *_ in CASES])
        return dict(zip([c[0] for c in CASES], done))


def test_the_core_venv_lacks_every_extra_and_every_help_runs(core: Path, tmp_path: Path):
    """The test is honest (moelora is the wheel's, and no extra's package imports), and
    `moelora COMMAND --help` prints every command's usage (in one interpreter: each one
    imports torch)."""
    script = (
        "import contextlib, importlib, io, moelora\n"
        "from moelora.cli import COMMANDS, main\n"
        f"for name in {sorted(EXTRA_OF)!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "        print('imported', name)\n"
        "    except ModuleNotFoundError:\n"
        "        pass\n"
        "for command in COMMANDS:\n"
        "    out = io.StringIO()\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(out):\n"
        "        main([command.replace('_', '-'), '--help'])\n"
        "    print(out.getvalue().split('\\n')[0])\n"
        "print(moelora.__file__)\n"
    )
    done = subprocess.run([core / "python", "-c", script], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stderr == "", done.stderr
    *usages, where = done.stdout.splitlines()
    commands = ["generate", "serve", "run-batch", "demo", "plan", "validate", "bench", "presets"]
    assert [u.split()[:3] for u in usages] == [["usage:", "moelora", c] for c in commands], usages
    assert where.startswith(str(core.parent)), where  # the wheel's moelora, not the checkout's


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_core_install_runs_or_names_the_extra(ran, case) -> None:
    name, _, code, words, line = case
    done = ran[name]
    assert done.returncode == code, f"{done.returncode}\n{done.stdout}\n{done.stderr}"
    assert all(w in done.stdout for w in words), done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    if line is None:
        assert done.stderr == "", done.stderr
        return
    (only,) = done.stderr.splitlines()  # one line, nothing else
    assert only.startswith(line), only
    assert only.endswith(FIXES.get(name, HF)), only


def test_the_extras_table_is_pyprojects(wheel: Path) -> None:
    """moelora/extras.py maps each package of an extra to that extra, as pyproject.toml
    lists them (an extra's own packages, not those of the extras it includes)."""
    for extra in sorted(set(EXTRA_OF.values())):
        requirements = wheel_requirements(wheel, extra)
        own = {canonicalize_name(r.name) for r in requirements if r.name != "moelora"}
        assert {p for p, e in EXTRA_OF.items() if e == extra} == own, extra
