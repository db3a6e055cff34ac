"""The command line as a newcomer meets it (issue 18), item by item. CLI runs are real
subprocesses (exit code, stream, the message's field and fix); in-process runs only where
a run must be stopped or stubbed (a 19-minute demo, a GPU-only path)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moelora import cli
from moelora.backends.checks import validation_status
from moelora.backends.registry import REGISTRY
from moelora.commands import demo as demo_cmd
from moelora.commands.cpu_cost import demo_cost
from moelora.commands.validate import table as validate_table
from moelora.deployment import Deployment
from moelora.device import target
from moelora.presets import PRESETS, load_preset

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")


def moelora(*argv: str, interpret: bool = True, timeout: int = 300):
    """`python -m moelora ARGV` as a user runs it, with or without TRITON_INTERPRET=1."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "moelora", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


moelora_run = moelora  # the helper's name, where a test imports the package as `moelora`


def in_process(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- 1. Checks that cannot fail -------------------------------------------------------
# (id, argv, TRITON_INTERPRET, lines the summary must print, words it must not)
DEMO_CHECKS = [
    ("no-interpret-unchecked", ("--no-interpret",), False,
     ["backend reference (auto fallback, refused: grouped_mm (device.kind = cpu",
      "checked against: nothing independent", "verdict: UNCHECKED",
      "Fix: drop --no-interpret (triton then checks it)"], ["PASS"]),
    ("rank-300-unchecked", ("--rank", "300"), True,
     ["backend reference (auto fallback, refused: grouped_mm (device.kind = cpu",
      "verdict: UNCHECKED", "Fix: --rank 256 (triton then checks it)"], ["PASS"]),
    ("explicit-reference-checked-by-triton", ("--moe-backend", "reference"), True,
     ["backend reference (explicit: --moe-backend reference)", "checked against: triton",
      "error vs triton", "verdict: PASS (reference vs triton)"], []),
    # auto on a CPU: triton would run interpreted (slower), so the reference runs, and
    # triton, interpreted, checks it
    ("auto-reference-checked-by-triton", (), True,
     ["backend reference (auto fallback, refused: grouped_mm (device.kind = cpu",
      "triton would run interpreted on this cpu (slower)", "checked against: triton",
      "verdict: PASS (reference vs triton)"], []),
    ("triton-checked-by-the-reference", ("--moe-backend", "triton"), True,
     ["device cpu (Triton interpreter): backend triton (explicit: --moe-backend triton)",
      "base-model rows (slot -1) vs the reference's LoRA-free run",
      "verdict: PASS (triton vs reference)"], ["backend's LoRA-free"]),
]  # fmt: skip


@pytest.mark.parametrize("argv, interpret, want, never", [c[1:] for c in DEMO_CHECKS],
                         ids=[c[0] for c in DEMO_CHECKS])  # fmt: skip
def test_demo_never_passes_the_reference_against_itself(argv, interpret, want, never):
    done = moelora("demo", "--tokens", "6", *argv, interpret=interpret)
    assert done.returncode == 0, done.stderr
    for line in want:
        assert line in done.stdout, (line, done.stdout)
    for word in never:
        assert word not in done.stdout


def test_demo_fails_when_the_check_disagrees(capsys, monkeypatch):
    # The check can fail: a reference that is 10% off must turn the verdict into FAIL, exit 1.
    real = demo_cmd.moe_lora_reference
    monkeypatch.setattr(demo_cmd, "moe_lora_reference", lambda *a, **k: real(*a, **k) * 1.1)
    code, out, _ = in_process(capsys, "demo", "--tokens", "6", "--moe-backend", "triton")
    assert code == 1 and "verdict: FAIL (triton vs reference)" in out


# --- 2. One device meaning -----------------------------------------------------------
def test_local_and_named_cpu_say_why_they_differ_about_triton():
    local = moelora("plan", "--model", "tiny", "--moe-backend", "triton", interpret=False)
    named = moelora("plan", "--model", "tiny", "--moe-backend", "triton", "--device", "cpu",
                    interpret=False)  # fmt: skip
    assert (local.returncode, named.returncode) == (3, 0)
    assert "device facts (--device local: probed on this machine)" in local.stdout
    assert re.search(r"triton_interpreted +no +probed: TRITON_INTERPRET is not set", local.stdout)
    assert "device facts (--device cpu: a named target, not this machine)" in named.stdout
    assert re.search(r"triton_interpreted +yes +assumed: TRITON_INTERPRET=1", named.stdout)
    why = "note: --device cpu assumes TRITON_INTERPRET=1 and this machine does not set it"
    assert why in local.stdout and why in named.stdout  # both say why they disagree
    assert "Fix: export TRITON_INTERPRET=1" in local.stdout
    assert "export TRITON_INTERPRET=1 (triton then accepts it)" in local.stderr


def test_local_and_named_cpu_agree_when_the_machine_interprets(capsys):
    # conftest sets TRITON_INTERPRET=1: this machine is then what the cpu target assumes.
    code, out, _ = in_process(capsys, "plan", "--model", "tiny", "--moe-backend", "triton")
    assert code == 0 and "note:" not in out


# --- 3. Refusal texts ----------------------------------------------------------------
def test_fully_sharded_refusal_names_the_sharding_and_the_fix():
    done = moelora("plan", "--model", "qwen3-30b-a3b", "-tp", "2", "--enable-lora",
                   "--fully-sharded-loras", "--moe-backend", "grouped_mm", "--device", "h200",
                   "--enforce-eager")  # fmt: skip
    assert done.returncode == 3
    assert "grouped_mm lora: lora.sharding = fully_sharded: needs one of unsharded, tp LoRA" in (
        done.stdout
    )
    assert "lora.add_inputs" not in done.stdout
    fix = (
        "use --moe-backend triton (or auto); or without --fully-sharded-loras "
        "(grouped_mm then accepts it)"
    )
    assert f"fix: {fix}" in done.stdout.splitlines()  # in the table, as in --json
    assert f"moelora plan: refused. Fix: {fix}" in done.stderr


def test_rank_no_backend_takes_names_the_nearest_deployments():
    done = moelora("plan", "--model", "tiny", "--enable-lora", "--max-lora-rank", "100000",
                   "--device", "h200")  # fmt: skip
    assert done.returncode == 3
    assert "[2] triton lora: lora.max_rank = 100000: needs at most 256" in done.stdout
    assert "fix: --max-lora-rank 256 (triton then accepts it); or --enforce-eager (reference " in (
        done.stdout
    )


def _apply(argv: list[str], changes: list[str], backend: str) -> list[str]:
    """argv with a nearest deployment's changes applied, requesting that backend, as JSON."""
    out = [a for a in argv if a != "--json"]
    for change in changes:
        words = change.split()
        if words[0] == "without":  # "without --fully-sharded-loras"
            out.remove(words[1])
            continue
        if words[0] == "export":  # TRITON_INTERPRET=1: conftest sets it for this process
            continue
        for i, flag in enumerate(words):
            if not flag.startswith("-"):
                continue
            value = (
                words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("-") else None
            )
            if flag in out and value is not None:
                out[out.index(flag) + 1] = value
            elif flag not in out:
                out += [flag] if value is None else [flag, value]
    if "--moe-backend" in out:
        out[out.index("--moe-backend") + 1] = backend
    else:
        out += ["--moe-backend", backend]
    return [*out, "--json"]


REFUSALS = [
    ("rank-100000", "--model tiny --enable-lora --max-lora-rank 100000 --device h200"),
    ("gmm-fully-sharded", "--model qwen3-30b-a3b -tp 2 --enable-lora --fully-sharded-loras "
     "--moe-backend grouped_mm --device h200 --enforce-eager"),
    ("gmm-on-cpu", "--model tiny --moe-backend grouped_mm --device cpu"),
    ("gmm-graphs-fp32", "--model tiny --moe-backend grouped_mm --device h200"),
    ("triton-rank-512", "--model tiny --moe-backend triton --device h200 --enable-lora "
     "--max-lora-rank 512 --max-loras 4"),
    ("reference-graphs", "--model qwen3-30b-a3b --moe-backend reference --device b200"),
]  # fmt: skip


@pytest.mark.parametrize("argv", [r[1] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_every_nearest_deployment_named_runs(argv, capsys):
    # "Nearest deployment that would run" is a claim: each one named must be accepted.
    code, out, _ = in_process(capsys, "plan", *argv.split(), "--json")
    plan = json.loads(out)
    assert code == 3 and plan["nearest"] and plan["fix"] in plan["error"]
    for near in plan["nearest"]:
        fixed = _apply(["plan", *argv.split()], near["changes"], near["backend"])
        code, out, _ = in_process(capsys, *fixed)
        assert code == 0, (fixed, json.loads(out).get("verdict"))
        assert json.loads(out)["selected"] == near["backend"]


# --- 4. Hints that lead somewhere ----------------------------------------------------
def test_presets_command_lists_every_preset_with_its_shape():
    done = moelora("presets")
    assert done.returncode == 0 and done.stderr == ""
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()[1:]}
    assert list(rows) == list(PRESETS)
    for name, row in rows.items():
        s = load_preset(name).shape
        assert row[2:6] == [str(v) for v in (s.num_experts, s.top_k, s.hidden_size,
                                               s.intermediate_size)]  # fmt: skip


def test_a_dense_config_points_to_the_presets_command(tmp_path):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    done = moelora("plan", "--model", str(tmp_path / "llama"))  # a model directory
    assert done.returncode == 2 and done.stdout == ""
    assert "config key 'model_type' = 'llama'" in done.stderr
    assert "moelora presets" in done.stderr  # a command that exists (test above)


def test_model_takes_a_model_directory(tmp_path, capsys):
    folder = tmp_path / "Qwen3-30B-A3B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(PRESETS["qwen3-30b-a3b"]))
    code, out, _ = in_process(capsys, "plan", "--model", str(folder), "--device", "h200", "--json")
    assert code == 0 and json.loads(out)["deployment"]["name"] == "Qwen3-30B-A3B"
    (tmp_path / "empty").mkdir()
    code, out, err = in_process(capsys, "plan", "--model", str(tmp_path / "empty"))
    assert code == 2 and "config key 'model' =" in err and "holding config.json" in err


# --- 5. Help that helps --------------------------------------------------------------
def _subparsers():
    parser = cli.build_parser()
    [sub] = [a for a in parser._actions if a.dest == "command"]
    return parser, sub.choices


def test_every_flag_of_every_command_has_help():
    _, commands = _subparsers()
    missing = [
        f"{name} {action.option_strings[0]}"
        for name, parser in commands.items()
        for action in parser._actions
        if action.option_strings and action.dest != "help" and not (action.help or "").strip()
    ]
    assert missing == []


def test_choices_are_listed_in_the_help():
    _, commands = _subparsers()
    for name, dest in (("plan", "model"), ("demo", "model"), ("validate", "models")):
        [model] = [a for a in commands[name]._actions if a.dest == dest]
        assert all(preset in model.help for preset in PRESETS), name
    [suite] = [a for a in commands["bench"]._actions if a.dest == "suite"]
    from moelora.bench.cases import CASES

    assert list(suite.choices) == list(CASES) and all(s in suite.help for s in CASES)


def test_top_level_help_says_what_moelora_does():
    done = moelora("--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "LoRA adapters in one batch" in text and "exit codes (every command)" in text
    assert "dispatcher" not in text and "presets" in text
    # the main job first: the help names generate as what to start with
    assert "The main job is `generate`" in text and text.endswith("Start with: moelora generate")


def test_version_from_the_package_metadata():
    from importlib.metadata import version

    import moelora

    done = moelora_run("--version")
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout == f"moelora {version('moelora')}\n" == f"moelora {moelora.__version__}\n"


# --- 6. Exit codes and streams -------------------------------------------------------
# (argv, exit code, words on stderr); stdout stays empty: errors go to stderr only
STREAMS = [
    pytest.param("demo --moe-backend grouped_mm --tokens 4", 3,
                 ["grouped_mm: device.kind = cpu: needs one of cuda",
                  "Fix: use --moe-backend reference (or auto)"], id="demo-refused-is-3"),
    pytest.param("plan --model qwen3-30b-a3b -tp 5", 2,
                 ["'tensor_parallel_size' = 5", "Fix: pick a divisor of 768"],
                 id="plan-config-error-is-2"),
    pytest.param("validate --device cpu --backends reference", 2,
                 ["'--backends' = 'reference'", "Fix: --backends triton,grouped_mm"],
                 id="validate-reference-is-2"),
    pytest.param("demo --tokens 0", 2, ["error: argument --tokens"], id="demo-usage-is-2"),
    pytest.param("validate", 2, ["--device cuda: no CUDA device here", "Fix:"],
                 id="validate-no-cuda-is-2", marks=NO_GPU),
    pytest.param("bench", 2, ["no CUDA device here", "Fix:"], id="bench-no-cuda-is-2",
                 marks=NO_GPU),
]  # fmt: skip


@pytest.mark.parametrize("argv, code, words", STREAMS)
def test_errors_and_refusals_go_to_stderr_with_one_code_each(argv, code, words):
    done = moelora(*argv.split())
    assert done.returncode == code and done.stdout == "", (done.returncode, done.stdout)
    for word in words:
        assert word in done.stderr, (word, done.stderr)
    assert "Traceback" not in done.stderr


# --- 7. Cost warnings ----------------------------------------------------------------
# (model, what the issue measured on the CPU machine: seconds, bytes; None = not measured)
COSTS = [
    ("tiny", None, None),  # the demo's default: seconds
    ("gpt-oss-20b", 19 * 60, None),  # issue 18: 19 minutes in the Triton interpreter
    ("qwen3-30b-a3b", None, 14e9),  # issue 18: 14 GB
]


@pytest.mark.parametrize("model, seconds, memory", COSTS, ids=[c[0] for c in COSTS])
def test_demo_cost_estimate_matches_the_measured_runs(model, seconds, memory):
    cost = demo_cost(load_preset(model), 48, 4, 8, interpreted=True)
    assert cost.large == (model != "tiny")
    if seconds:
        assert seconds / 2 <= cost.seconds <= seconds * 2, cost
    if memory:
        assert memory / 2 <= cost.bytes <= memory * 2, cost


def test_demo_warns_with_an_estimate_before_it_starts():
    # A real run, stopped as soon as the warning is out: nothing is built before it.
    env = dict(os.environ, TRITON_INTERPRET="1")
    argv = ["demo", "--model", "olmoe-1b-7b", "--moe-backend", "triton"]  # interpreted
    proc = subprocess.Popen([sys.executable, "-m", "moelora", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)  # fmt: skip
    try:
        line = proc.stderr.readline()
    finally:
        proc.kill()
        proc.wait()
    assert line.startswith("moelora demo: warning: --model olmoe-1b-7b on this CPU (the Triton")
    assert re.search(r"takes about \d+ min and [\d.]+ GB of memory", line)
    assert "Fix: --model tiny runs in seconds" in line


def test_validate_on_cpu_defaults_to_seconds_and_warns_above(capsys, monkeypatch):
    ran = []
    monkeypatch.setattr(validate_table, "_run_one", lambda *a: ran.append((a[1], a[4])) or True)
    monkeypatch.setattr(validate_table, "build_experts", lambda *a: None)
    code, _, err = in_process(capsys, "validate", "--device", "cpu")
    assert code == 0 and err == ""
    assert {m for m, _ in ran} == set(validate_table.CPU_MODELS)
    assert max(case.tokens for _, case in ran) == max(validate_table.CPU_TOKENS) == 16
    ran.clear()
    code, _, err = in_process(capsys, "validate", "--device", "cpu", "--models", "qwen3-30b-a3b")
    assert code == 0 and "moelora validate: warning:" in err and "take about" in err
    assert "Fix: run on a GPU, or --models tiny,tiny-relu2" in err


# --- 8. A quiet setup ----------------------------------------------------------------
EDITABLE_NOTE = """  /tmp/pip-build-env-x/overlay/lib/python3.11/site-packages/setuptools/command/editable_wheel.py:354: BuildBackendWarning: Editable installation.
  !!

          ********************************************************************************
          Please be careful with folders in your working directory with the same
          name as your package as they may take precedence during imports.
          ********************************************************************************

  !!
    with strategy, WheelFile(wheel_path, "w") as wheel_obj:
"""  # what pip printed on the CPU machine before the fix

STUB_PYTHON = """#!/usr/bin/env bash
# test double of .venv/bin/python: pip prints the editable note (and fails on request)
if [ "$1" = "-c" ]; then echo "moelora ready: torch 2.13.0+cpu"; exit 0; fi
case "$*" in *"-e .[test]"*)
  echo "PYTHONWARNINGS=$PYTHONWARNINGS" > "$(dirname "$0")/../../pip-env"
  printf '%s' "$STUB_NOTE" >&2
  if [ -n "$STUB_FAIL" ]; then echo "ERROR: No matching distribution found for torch" >&2; exit 1; fi
esac
exit 0
"""


@pytest.mark.parametrize("fail", [False, True], ids=["ok", "pip-fails"])
def test_setup_is_quiet_but_shows_errors(tmp_path, fail):
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    stub = tmp_path / ".venv" / "bin" / "python"
    stub.parent.mkdir(parents=True)
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)
    env = dict(os.environ, STUB_NOTE=EDITABLE_NOTE, STUB_FAIL="1" if fail else "")
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], capture_output=True,
                          text=True, env=env)  # fmt: skip
    output = done.stdout + done.stderr
    assert "Editable installation" not in output and "!!" not in output and "****" not in output
    assert (tmp_path / "pip-env").read_text() == "PYTHONWARNINGS=ignore:Editable installation\n"
    if fail:
        assert done.returncode == 1 and "ERROR: No matching distribution found" in output
        assert "setup.sh: pip install failed (exit 1)" in output
    else:
        assert done.returncode == 0 and output == "moelora ready: torch 2.13.0+cpu\n"


# --- 9. Supported is not validated ---------------------------------------------------
def test_plan_warns_where_a_backend_was_never_validated():
    done = moelora("plan", "--model", "qwen3-30b-a3b", "--moe-backend", "triton", "--device",
                   "sm103")  # fmt: skip
    assert done.returncode == 0  # a warning, not a refusal
    assert re.search(r"validated here +no", done.stdout)
    assert (
        "moelora plan: warning: triton has not been validated on sm103 (compute capability "
        "10.3) in bfloat16" in done.stderr
    )
    assert (
        "It has been validated on: NVIDIA H200 (9.0) in bfloat16, float16, float32" in done.stderr
    )
    assert "Fix: run `moelora validate --backends triton` on that machine" in done.stderr


def test_plan_prints_where_it_was_validated(capsys):
    code, out, err = in_process(capsys, "plan", "--model", "qwen3-30b-a3b", "--device", "h200")
    assert code == 0 and "warning" not in err
    assert (
        "validated: triton on NVIDIA H200: moelora validate --ref-tokens 1024 at 4acd27b: " in out
    )


def _dep(device: str, dtype: torch.dtype) -> Deployment:
    model = load_preset("qwen3-30b-a3b")
    shape = dataclasses.replace(model.shape, dtype=dtype)
    return Deployment(shape=shape, routing=model.routing, device=target(device))


# (backend, target, dtype, level): GPU-free, from the records alone
VALIDATION_TABLE = [
    ("triton", "h200", torch.bfloat16, "validated"),
    ("triton", "h200", torch.float32, "validated"),
    ("triton", "h100", torch.bfloat16, "same_architecture"),  # sm90, another GPU
    ("triton", "sm90", torch.float16, "same_architecture"),  # a bare cc is no GPU
    ("triton", "a100", torch.bfloat16, "not_validated"),  # the record allows sm80
    ("triton", "sm103", torch.bfloat16, "not_validated"),
    ("triton", "cpu", torch.float32, "validated"),  # the test suite, interpreted
    ("triton", "cpu", torch.bfloat16, "other_dtype"),
    ("grouped_mm", "h200", torch.bfloat16, "validated"),
    ("grouped_mm", "h200", torch.float16, "other_dtype"),
    ("grouped_mm", "b200", torch.bfloat16, "not_validated"),
    ("reference", "cpu", torch.bfloat16, "validated"),
    ("reference", "b300", torch.float32, "not_validated"),
]


@pytest.mark.parametrize("backend, device, dtype, level", VALIDATION_TABLE,
                         ids=[f"{b}-{d}-{str(t)[6:]}" for b, d, t, _ in VALIDATION_TABLE])  # fmt: skip
def test_validation_table(backend, device, dtype, level):
    status = validation_status(REGISTRY[backend].capabilities, _dep(device, dtype))
    assert status.level == level


def test_validation_records_come_from_benchmarks_md():
    # Every GPU run a record cites is in the benchmark history with its commit and count.
    text = (ROOT / "docs" / "history" / "benchmarks.md").read_text()
    for name in ("triton", "grouped_mm"):
        for run in REGISTRY[name].capabilities.validated_on:
            if run.kind != "cuda":
                continue
            commits = re.findall(r"at ([0-9a-f]{7})", run.result)
            counts = re.findall(r"(\d+/\d+)", run.result)
            assert commits and counts, run.result
            assert all(c in text for c in commits + counts), run.result
            assert run.device in text and run.date in text
