"""Every command exits with one of the documented codes (moelora/cli.py EPILOG: 0, 1, 2, 3,
130), never a traceback (issue 34): a count flag of 0 or below and a prompt that is not
UTF-8 are refused while the command line is parsed (exit 2, naming the flag, the value and
what is expected), and Ctrl-C prints one line and exits 130."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from moelora import cli

ROOT = Path(__file__).resolve().parent.parent


def _moelora(argv: list, **kw) -> subprocess.Popen:
    """`python -m moelora ARGV` (str or bytes arguments) as a user runs it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.Popen([sys.executable, "-m", "moelora", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)  # fmt: skip


# (id, argv, the line argparse ends stderr with): the cases, as a user typed them
REFUSED = [
    ("max-new-tokens-zero", ["generate", "--max-new-tokens", "0"],
     b"moelora generate: error: argument --max-new-tokens: '0': expected an integer >= 1"),
    ("max-new-tokens-negative", ["generate", "--max-new-tokens", "-3"],
     b"moelora generate: error: argument --max-new-tokens: '-3': expected an integer >= 1"),
    # bytes that are not UTF-8 (a Latin-1 terminal, a binary file pasted)
    ("prompt-not-utf8", ["generate", "--prompt", b"\xff\xfe"],
     b"moelora generate: error: argument --prompt: b'\\xff\\xfe' is not UTF-8: expected UTF-8 "
     b"text (re-encode it, e.g. iconv -t UTF-8)"),
]  # fmt: skip


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_nonsense_is_refused_with_exit_2_not_a_traceback(case) -> None:
    _, argv, line = case
    out, err = _moelora(argv).communicate(timeout=120)
    lines = err.splitlines()
    assert b"Traceback" not in err and lines[-1] == line, err.decode(errors="replace")
    assert lines[0].startswith(b"usage: moelora generate") and out == b""


# (id, argv, the flag and value argparse names): every count flag of the commands
COUNTS = [
    ("generate-max-loras", ["generate", "--max-loras", "0"], "--max-loras: '0'"),
    ("generate-max-lora-rank", ["generate", "--max-lora-rank", "-1"], "--max-lora-rank: '-1'"),
    # demo's were refused before, in words of their own
    ("demo-tokens", ["demo", "--tokens", "0"], "--tokens: '0'"),
    ("demo-adapters", ["demo", "--adapters", "-2"], "--adapters: '-2'"),
    ("demo-rank", ["demo", "--rank", "0"], "--rank: '0'"),
    # 0 compared no row and passed
    ("validate-ref-tokens", ["validate", "--ref-tokens", "0"], "--ref-tokens: '0'"),
    ("validate-serving-slots", ["validate", "--serving-slots", "0"], "--serving-slots: '0'"),
    ("validate-serving-rounds", ["validate", "--serving-load-rounds", "-1"],
     "--serving-load-rounds: '-1'"),
    ("bench-iters", ["bench", "--iters", "0"], "--iters: '0'"),
    ("bench-tokens", ["bench", "--tokens", "16,x"], "--tokens: '16,x'"),
    ("bench-tokens-zero", ["bench", "--tokens", "0"], "--tokens: '0'"),
    ("not-a-number", ["generate", "--max-new-tokens", "many"], "--max-new-tokens: 'many'"),
]  # fmt: skip


@pytest.mark.parametrize("case", COUNTS, ids=[c[0] for c in COUNTS])
def test_count_flags_refuse_zero_and_below(case, capsys) -> None:
    _, argv, named = case
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert f"argument {named}: expected " in err and "integer" in err, err


def test_ctrl_c_prints_one_line_and_exits_130() -> None:
    """SIGINT while `moelora validate` runs its cases (after its table's header)."""
    run = _moelora(["validate", "--device", "cpu", "--models", "tiny"], text=True)
    try:
        header = run.stdout.readline()
        assert header.startswith("backend"), header
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert (run.returncode, err) == (130, "moelora validate: interrupted\n"), err


@pytest.mark.parametrize("command", cli.COMMANDS)
def test_ctrl_c_during_any_command(command, monkeypatch, capsys) -> None:
    """Each command's run interrupted (its parser built as a user's line builds it)."""

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(f"moelora.commands.{command}"), "run", interrupted)
    name = command.replace("_", "-")
    argv = {"serve": ["serve", "DIR"], "run_batch": ["run-batch", "DIR", "-i", "a", "-o", "b"],
            "plan": ["plan", "--model", "tiny"]}.get(command, [name])  # fmt: skip
    try:
        code = cli.main(argv)
    except KeyboardInterrupt:  # raised on, it would stop this test session too
        pytest.fail("KeyboardInterrupt left moelora.cli.main (a traceback for the user)")
    assert code == 130
    assert capsys.readouterr().err == f"moelora {name}: interrupted\n"


def test_the_exit_codes_are_documented() -> None:
    assert "130 interrupted" in cli.EPILOG
