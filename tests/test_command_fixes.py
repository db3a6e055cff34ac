"""A refusal's fix line in the flags of the command that prints it (issue 34). The oracle's
nearest deployments speak `moelora plan`'s flags (--device, -tp, --enforce-eager, ...);
every command restates them with the flags its own parser has (commands/flag_terms.py,
called by cli.py), so that no fix tells a user to pass a flag the command lacks: `serve`
has no --device, so a device change reads as the machine to run on."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moelora.cli import build_parser
from moelora.commands.flag_terms import refusal_in_flags
from moelora.errors import UnsupportedDeploymentError
from moelora.presets import preset_dict

ROOT = Path(__file__).resolve().parent.parent

# The arguments each command requires, to parse its flags.
REQUIRED = {
    "plan": ["--model", "tiny"],
    "serve": ["DIR"],
    "run-batch": ["DIR", "-i", "in", "-o", "out"],
    "generate": [],
    "demo": [],
}
GPU = ("--device h200 --enforce-eager", "--dtype bfloat16")  # grouped_mm's from a CPU
NONE = "no setting of this deployment that moelora can change"

# (id, command, nearest deployments as the oracle names them (plan's flags), the fix)
FIXES = [
    ("plan-keeps-device", "plan", [("grouped_mm", GPU)],
     "--device h200 --enforce-eager --dtype bfloat16 (grouped_mm then accepts it)"),
    ("serve-names-the-gpu", "serve", [("grouped_mm", GPU)],
     "run on an NVIDIA H200 with --enforce-eager --dtype bfloat16 (grouped_mm then accepts it)"),
    ("run-batch-names-the-gpu", "run-batch", [("grouped_mm", GPU)],
     "run on an NVIDIA H200 with --enforce-eager --dtype bfloat16 (grouped_mm then accepts it)"),
    ("generate-device-alone", "generate", [("grouped_mm", ("--device h200",))],
     "run on an NVIDIA H200 (grouped_mm then accepts it)"),
    # generate has no --enforce-eager (it replays CUDA graphs on a GPU): no fix it can take
    ("generate-lacks-enforce-eager", "generate", [("grouped_mm", GPU)], NONE),
    ("a-capability-target-is-a-gpu", "serve", [("triton", ("--device sm90",))],
     "run on an sm90 GPU (triton then accepts it)"),
    ("cpu-target", "serve", [("reference", ("--device cpu",))],
     "run on a CPU (reference then accepts it)"),
    ("generate-flags-kept", "generate",
     [("triton", ("--max-lora-rank 256",)), ("ref", ("--dtype float32",))],
     "--max-lora-rank 256 (triton then accepts it); or --dtype float32 (ref then accepts it)"),
    # generate has no -tp, --enforce-eager or --lora-add-inputs: those remedies are left out
    ("plan-only-flags-dropped", "generate",
     [("a", ("-tp 1",)), ("b", ("--enforce-eager",)),
      ("c", ("--max-loras 8", "--lora-add-inputs add"))], NONE),
    ("serve-has-enforce-eager", "serve", [("b", ("--enforce-eager",))],
     "--enforce-eager (b then accepts it)"),
    ("without-a-flag-it-lacks", "generate", [("a", ("without --enable-lora",))], NONE),
    # a flag serve refuses (hidden from its --help) is not one a fix may name
    ("a-refused-flag-is-not-a-fix", "serve", [("a", ("-tp 1 without expert parallel",))], NONE),
    ("environment-kept", "serve", [("triton", ("export TRITON_INTERPRET=1",))],
     "export TRITON_INTERPRET=1 (triton then accepts it)"),
    # the demo restates its fixes itself (--rank for --max-lora-rank): kept as they are
    ("demo-own-words-kept", "demo",
     [("triton", ("run on an NVIDIA H200",)), ("ref", ("--rank 8 --adapters 4",))],
     "run on an NVIDIA H200 (triton then accepts it); or --rank 8 --adapters 4 (ref then"),
]  # fmt: skip


def flags_of(command: str) -> frozenset[str]:
    return build_parser().parse_args([command, *REQUIRED[command]]).command_flags


@pytest.mark.parametrize("case", FIXES, ids=[c[0] for c in FIXES])
def test_a_fix_names_only_the_commands_own_flags(case) -> None:
    _, command, nearest, fix = case
    flags = flags_of(command)
    err = refusal_in_flags(UnsupportedDeploymentError("auto", {"x": []}, [], nearest), flags)
    assert err.fix.startswith(fix), err.fix
    named = set(re.findall(r"(?<!\S)--?[a-z][\w-]*", err.fix))
    assert named <= flags, named - flags


def _moelora(*argv: str) -> subprocess.CompletedProcess:
    """`python -m moelora ARGV` in this checkout, as a user runs it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "moelora", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


# (id, argv, words in stderr); MODEL is a directory holding the tiny preset's config.json,
# IN an empty batch file
REFUSED = [
    # the case: serve has no --device, and its fix named it
    ("serve", ["serve", "MODEL", "--moe-backend", "grouped_mm"],
     ["grouped_mm: device.kind = cpu", "Fix: use --moe-backend reference (or auto); or run on "
      "an NVIDIA H200 with --enforce-eager --dtype bfloat16 (grouped_mm then accepts it)"]),
    ("run-batch", ["run-batch", "MODEL", "-i", "IN", "-o", "OUT", "--moe-backend",
                   "grouped_mm"], ["or run on an NVIDIA H200 with --enforce-eager"]),
    # plan has --device: its fix keeps it
    ("plan", ["plan", "--model", "MODEL", "--enable-lora", "--max-loras", "4", "--moe-backend",
              "grouped_mm"], ["--device h200 --enforce-eager --dtype bfloat16 (grouped_mm then"]),
]  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="grouped_mm is refused on a CPU only")
@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_a_refused_deployment_tells_each_command_what_it_can_do(case, tmp_path) -> None:
    name, argv, words = case
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(preset_dict("tiny")))
    (tmp_path / "in.jsonl").write_text("")
    paths = {"MODEL": tmp_path / "model", "IN": tmp_path / "in.jsonl", "OUT": tmp_path / "o.jsonl"}
    done = _moelora(*[str(paths.get(a, a)) for a in argv])
    assert done.returncode == 3, done.stdout + done.stderr
    assert all(w in done.stderr for w in words), done.stderr
    assert ("--device" in done.stderr + done.stdout) == (name == "plan"), done.stderr
