"""Ctrl-C while a command loads (moelora/interrupt.py): one line and exit code 130 at once,
also where Python's KeyboardInterrupt would be lost (raised inside a finalizer it is only
printed, and the program went on: how `moelora serve` once ignored a Ctrl-C during its
load); cli.main called inside another process never installs or changes a handler."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import time
{install}
class Slow:
    def __del__(self):
        print("ready", flush=True)
        time.sleep(30)
slow = Slow()
del slow  # Ctrl-C arrives inside the finalizer
print("went on", flush=True)
"""


def _run_child(install: str) -> tuple[int, str]:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(install=install)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, out


def test_ctrl_c_inside_a_finalizer_exits_at_once_with_one_line():
    code, out = _run_child("from moelora.interrupt import install; install()")
    assert (code, out) == (130, "moelora: interrupted\n")


def test_without_it_the_interrupt_is_lost_in_the_finalizer():
    """The control: Python's own handler raises KeyboardInterrupt inside __del__, where it
    is printed and ignored, and the program goes on."""
    code, out = _run_child("")
    assert code == 0 and "went on" in out and "KeyboardInterrupt" in out, out


def test_command_parsed_changes_nothing_where_install_did_not_run():
    from moelora import interrupt

    before = signal.getsignal(signal.SIGINT)
    interrupt.command_parsed("validate", loads_only=False)
    interrupt.command_parsed("serve", loads_only=True)
    assert signal.getsignal(signal.SIGINT) is before and interrupt._label == ["moelora"]


@pytest.mark.parametrize(("command", "loads_only"), [("serve", True), ("validate", False)])
def test_command_parsed_names_the_command_and_hands_back_ctrl_c_unless_it_only_loads(
    command, loads_only, monkeypatch
):
    from moelora import interrupt

    monkeypatch.setattr(interrupt, "_label", ["moelora"])
    before = signal.getsignal(signal.SIGINT)
    try:
        interrupt.install()
        interrupt.command_parsed(command, loads_only)
        now = signal.getsignal(signal.SIGINT)
        assert interrupt._label == [f"moelora {command}"]
        assert now is (interrupt.exit_now if loads_only else signal.default_int_handler)
    finally:
        signal.signal(signal.SIGINT, before)
