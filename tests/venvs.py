"""Fresh venvs that hold the package as a user installs it: the wheel of this tree, built
without build isolation and installed without dependencies or an index (nothing is
downloaded). Its dependencies come from this test venv through a .pth file naming one
folder: either this venv's whole site-packages (tests/test_wheel.py) or a folder of links
to the distributions of a requirement closure only (tests/test_core_install.py), so that
what the core install lacks is missing there too. A .pth line adds its folder; the .pth
files inside that folder are not run, so this venv's editable moelora stays out."""

from __future__ import annotations

import email
import os
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list, cwd: Path, **kw) -> subprocess.CompletedProcess:
    """`cmd` without this session's PYTHONPATH / PYTHONHOME; it must exit 0."""
    done = subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True, **kw)
    assert done.returncode == 0, f"{cmd}: {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def build_wheel(tmp: Path) -> Path:
    """The wheel of this tree, in `tmp`."""
    pip = [sys.executable, "-m", "pip"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp, ROOT], cwd=tmp)
    (wheel,) = tmp.glob("moelora-*.whl")
    return wheel


def wheel_requirements(wheel: Path, extra: str = "") -> list[Requirement]:
    """The wheel's Requires-Dist lines that `pip install` of it installs (extra ""), or that
    `extra` adds to those."""
    with zipfile.ZipFile(wheel) as whl:
        (name,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(whl.read(name))
    requirements = [Requirement(line) for line in meta.get_all("Requires-Dist") or []]
    core = [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]
    if not extra:
        return core
    return [r for r in requirements if r not in core and r.marker.evaluate({"extra": extra})]


def closure(requirements: list[Requirement]) -> list[metadata.Distribution]:
    """The distributions of this venv that installing `requirements` brings, recursively:
    environment markers evaluated here, extras' requirements left out."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(requirements)
    while todo:
        requirement = todo.pop()
        key = canonicalize_name(requirement.name)
        if key in seen:
            continue
        seen[key] = dist = metadata.distribution(requirement.name)
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}):
                todo.append(sub)
    return list(seen.values())


def link_distributions(dists: list[metadata.Distribution], folder: Path) -> Path:
    """`folder` holding a link to each top-level file or directory the distributions
    installed (their RECORD), .dist-info included; scripts and .pth files left out."""
    folder.mkdir()
    for dist in dists:
        assert dist.files is not None, f"{dist.name} has no RECORD"
        tops = {f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__")}
        for top in sorted(t for t in tops if not t.endswith(".pth")):
            source = Path(dist.locate_file(top))
            if source.exists() and not (folder / top).exists():
                (folder / top).symlink_to(source)
    return folder


def fresh_venv(tmp: Path, wheel: Path, deps: Path) -> Path:
    """The bin folder of a new venv in `tmp` with `wheel` installed and `deps` on its path."""
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    python = venv / "bin" / "python"
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp)
    Path(site.stdout.strip(), "deps.pth").write_text(f"{deps}\n")
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
         "--no-index", "--ignore-installed", wheel], cwd=tmp)  # fmt: skip
    return venv / "bin"
