"""`moelora validate --suite slots | hf | serving` (moelora/commands/validate/suites/): the
check suites run their own cases instead of the layer table; on a CPU each runs what it can
(serving at tiny shapes through Triton's interpreter, hf's torch.compile case) or refuses
naming what it needs (slots); a failing case or a suite that stops exits 1; a refused
setting changes nothing. The GPU runs the real shapes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moelora import cli
from moelora.commands import validate as validate_cmd
from moelora.commands.validate.suites import CheckSuite, Outcome, Verdict, run_suite, slots

CPU = ["validate", "--device", "cpu"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # cuda: asked for, none here
def test_slots_suite_refuses_a_cpu_naming_what_it_needs(device, capsys, monkeypatch) -> None:
    monkeypatch.setattr(validate_cmd.torch.cuda, "is_available", lambda: False)
    code = cli.main(["validate", "--device", device, "--suite", "slots"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""  # nothing ran
    assert "--suite slots needs a CUDA device" in err and "queued behind a released lease" in err
    assert "--device cpu (Triton" not in err  # no hint at a CPU run it would refuse


# (id, verdict function, its inputs, expected outcome): what each slots case calls a pass
SLOTS_VERDICTS = [
    ("lease-waited", slots.lease_verdict, ("a", 0.104), Outcome.PASS),  # the H200 run
    ("lease-no-wait", slots.lease_verdict, ("a", 0.0004), Outcome.FAIL),  # 'a' by luck
    ("lease-raced", slots.lease_verdict, ("b", 0.104), Outcome.FAIL),  # copy saw the new one
    ("control-raced", slots.control_verdict, ("b", 0.0004), Outcome.PASS),
    ("control-zeroed", slots.control_verdict, ("zeros", 0.0004), Outcome.PASS),
    ("control-no-race", slots.control_verdict, ("a", 0.0004), Outcome.FAIL),  # proves nothing
    ("capture-clean", slots.capture_verdict, ("",), Outcome.PASS),
    ("capture-lease-held", slots.capture_verdict, ("lease still held",), Outcome.FAIL),
]


@pytest.mark.parametrize(
    "judge,inputs,want", [c[1:] for c in SLOTS_VERDICTS], ids=[c[0] for c in SLOTS_VERDICTS]
)
def test_slots_verdicts(judge, inputs, want) -> None:
    assert judge(*inputs).outcome is want


def _fake(name: str, verdicts: list[Verdict], stop: bool = False) -> CheckSuite:
    def run(args, device, backend):
        yield from verdicts
        if stop:
            raise RuntimeError("the device went away")

    return CheckSuite(name=name, summary="", cpu_refusal=None, run=run)


# (id, verdicts, raises after them, failures counted, fragment printed)
RUNS = [
    ("all-pass", [Verdict.of("a", True, "ok")], False, 0, "1/1 passed"),
    ("one-fail", [Verdict.of("a", True, "ok"), Verdict.of("b", False, "off")], False, 1,
     "1/2 passed — FAILURES"),
    ("not-run-uncounted", [Verdict("g", Outcome.NOT_RUN, "needs CUDA")], False, 0, "0/0 passed"),
    ("stopped", [Verdict.of("a", True, "ok")], True, 1, "suite stopped: RuntimeError"),
]  # fmt: skip


@pytest.mark.parametrize("verdicts,stop,failures,fragment", [r[1:] for r in RUNS],
                         ids=[r[0] for r in RUNS])  # fmt: skip
def test_run_suite_counts_failures(verdicts, stop, failures, fragment, capsys) -> None:
    assert run_suite(_fake("x", verdicts, stop), None, "cpu", "triton") == failures
    assert fragment in capsys.readouterr().out


# (id, --suite values, the layer table runs, check suites run)
SELECTION = [
    ("check-alone", ["hf"], False, ["hf"]),
    ("check-and-layer", ["hf", "ranks"], True, ["hf"]),
    ("two-checks-once-each", ["serving", "hf", "serving"], False, ["serving", "hf"]),
    ("layer-alone", ["ranks"], True, []),
]


@pytest.mark.parametrize("suites,table,checks", [s[1:] for s in SELECTION],
                         ids=[s[0] for s in SELECTION])  # fmt: skip
def test_check_suites_replace_the_table_unless_a_layer_suite_is_named(
    suites, table, checks, monkeypatch
) -> None:
    ran, tables = [], []
    monkeypatch.setattr(validate_cmd, "layer_table", lambda *a: tables.append(a) or 0)
    monkeypatch.setattr(validate_cmd, "run_suite", lambda s, *a: ran.append(s.name) or 0)
    argv = [*CPU, "--models", "tiny"] + [a for s in suites for a in ("--suite", s)]
    assert cli.main(argv) == 0
    assert bool(tables) == table and ran == checks


def test_a_failing_check_suite_exits_1(monkeypatch, capsys) -> None:
    suites = {"hf": _fake("hf", [Verdict.of("torch.compile", False, "3 nodes (want 2)")])}
    monkeypatch.setattr(validate_cmd, "CHECK_SUITES", suites)
    assert cli.main([*CPU, "--suite", "hf"]) == 1
    assert "FAIL    torch.compile: 3 nodes (want 2)" in capsys.readouterr().out


SERVING = [*CPU, "--suite", "serving", "--models", "tiny", "--rank", "4", "--tokens", "8",
           "--serving-layers", "1", "--serving-forwards", "1"]  # fmt: skip

# (id, serving settings, fragment of the refusal): every cold load must be a miss
REFUSED = [
    ("no-cold-miss", ["--serving-slots", "8", "--serving-hot", "4", "--serving-cold", "4"],
     "cold > slots - hot"),
    ("hot-fills-slots", ["--serving-slots", "4", "--serving-hot", "4"], "0 < hot < slots"),
]  # fmt: skip


@pytest.mark.parametrize("argv,fragment", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_serving_refuses_settings_it_cannot_measure(argv, fragment, capsys) -> None:
    assert cli.main([*SERVING, *argv]) == 2
    out, err = capsys.readouterr()
    assert fragment in err and "validate --suite" not in out  # refused before anything ran


def test_serving_runs_on_tiny_shapes(tmp_path, capsys) -> None:
    """The serving suite end to end on the CPU (tiny preset, fp32, the triton backend
    interpreted): both cases pass, every cold load comes from the host cache, loads ran
    beside the forwards, the counters add up."""
    path = tmp_path / "serving.json"
    assert cli.main([*SERVING, "--serving-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "pass    slots bit-exact: 4/4" in out and "validate --suite serving (triton): 2/2" in out
    result = json.loads(path.read_text())
    assert result["checks"]["ok"] and result["checks"]["rel_err"] <= result["checks"]["tol"]
    assert result["backend"] == "triton" and result["model"]["moe_layers"] == 1
    assert result["loads_alone"]["loads"] == 4 and result["loads_alone"]["origins"] == ["host"]
    assert result["loads_beside_forwards"]["loads"] > 0
    stats = result["stats"]
    assert sum(stats["loads"].values()) == stats["misses"] + stats["explicit_loads"]
    assert stats["host_adapters"] <= stats["host_capacity"] == 4


def test_serving_needs_no_http_packages() -> None:
    """The GPU machine has neither fastapi nor pydantic: validate and its suites import none."""
    code = (
        "import sys; from moelora import cli; cli.build_parser()\n"
        "import moelora.commands.validate.suites.serving\n"
        "bad = [m for m in ('fastapi', 'pydantic', 'uvicorn') if m in sys.modules]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hf_suite_runs_torch_compile_on_a_cpu(capsys) -> None:
    """On a CPU the hf suite runs its torch.compile case on the toy model (one node per MoE
    layer, logits equal to eager) and lists the three CUDA-graph cases as not run."""
    assert cli.main([*CPU, "--suite", "hf"]) == 0
    out = capsys.readouterr().out
    assert "pass    torch.compile: 2 moelora.experts nodes (want 2" in out
    for case in ("graph replay", "graph follows slots", "decode graphs"):
        assert f"not run {case}: needs a CUDA device" in out
    assert "validate --suite hf (triton): 1/1 passed" in out


def test_hf_suite_refuses_without_peft_before_anything_runs(monkeypatch, capsys) -> None:
    from moelora.commands.validate.suites import hf

    monkeypatch.setattr(hf, "installed_packages", lambda: frozenset({"torch", "transformers"}))
    assert cli.main([*CPU, "--suite", "hf"]) == 2
    out, err = capsys.readouterr()
    assert "peft missing" in err and "pip install 'moelora[hf]'" in err and out == ""


def test_parallel_suite_runs_two_gloo_processes_on_a_cpu(monkeypatch, capsys) -> None:
    """Two layouts (the runs are made here and handed to the spawned processes): fully
    sharded TP and EP, each with the triton backend (interpreted, fp32) and the reference
    backend, every row against the single-process reference."""
    from moelora.commands.validate.suites import parallel

    keep = [c for c in parallel.CASES if c[0] in ("fs-tp2-silu", "ep2-silu")]
    monkeypatch.setattr(parallel, "CASES", keep)
    assert cli.main([*CPU, "--suite", "parallel", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("  pass ")]
    assert len(rows) == 4 and all("against the single-process reference" in r for r in rows)
    assert {r.split()[1] for r in rows} == {"triton", "reference"}
    assert "validate --suite parallel (triton): 4/4 passed" in out


def test_parallel_suite_refuses_fewer_gpus_than_processes(monkeypatch) -> None:
    import torch

    from moelora.commands.validate.suites import parallel
    from moelora.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"2 GPUs \(one per process; found 1\)"):
        parallel.check_gpus(None, "cuda")
