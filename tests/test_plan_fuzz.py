"""`moelora plan` over 2000 random flag combinations (issue 17.4): presets, random valid
and invalid config.json files and model directories, tp 1-16 (and a few bad values), every
flag. No traceback; every exit code is 0, 2 or 3 with docs/plan.md's meaning, checked
against the plan's own per-backend table; `--json` is always exactly one JSON document;
the table and the JSON agree. The combinations run in-process through cli.main (fast); a
handful run again in subprocesses, as a user runs them."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import pytest

from moelora import cli
from moelora.backends.registry import REGISTRY
from moelora.device import TARGETS
from moelora.presets import PRESETS, preset_dict

COMBINATIONS = 2000
ROOT = Path(__file__).resolve().parents[1]

BACKENDS = ["auto", "auto", *REGISTRY, "cutlass"]
DEVICES = ["local", *TARGETS, "tpu"]
TARGET_MODULES = [["q_proj", "v_proj"], ["experts"], ["down_proj"], ["gate_proj,up_proj"],
                  ["all-linear"], [r".*\.experts\..*"], ["(unclosed"]]  # fmt: skip
# values a user may mistype, for the integer flags
BAD_INTS = ["0", "-1", "two", "1.5", ""]


def _config_files(root: Path, rng: random.Random) -> tuple[list[str], list[str]]:
    """(valid, invalid) paths --model takes, config.json files and model directories: valid
    are resized presets; invalid have bad keys and values, a dense model, no JSON, none."""
    paths = []
    for i in range(24):  # valid: a preset with other sizes
        cfg = preset_dict(rng.choice(list(PRESETS)))
        body = cfg.get("text_config", cfg)
        for key in ("hidden_size", "moe_intermediate_size", "intermediate_size"):
            if key in body:
                body[key] = rng.choice([48, 64, 96, 100, 128, 768, 1000])
        paths.append(_write(root / f"valid{i}", cfg, rng))
    spoilers = [
        lambda c: c.update(model_type="llama"),  # a dense model
        lambda c: c.pop("model_type", None),
        lambda c: c.update(hidden_size=-8),
        lambda c: c.update(hidden_size="wide"),
        lambda c: c.update(num_experts_per_tok=10**6),
        lambda c: c.update(num_experts_per_tok=None, num_experts=0),
        lambda c: c.update(hidden_act="tanh", mlp_hidden_act=7),
        lambda c: c.update(torch_dtype="int8", dtype=["bf16"]),
        lambda c: c.update(num_hidden_layers=0),
        lambda c: c.update(mlp_only_layers=[99], decoder_sparse_step=0),
        lambda c: c.update(n_group=3, topk_group=9),
        lambda c: c.update(text_config="not a dict"),
        lambda c: c.update(swiglu_limit="x", routed_scaling_factor=float("nan")),
        lambda c: c.clear(),
    ]
    for i, spoil in enumerate(spoilers * 2):
        cfg = preset_dict(rng.choice(list(PRESETS)))
        spoil(cfg.get("text_config", cfg) if rng.random() < 0.5 else cfg)
        paths.append(_write(root / f"invalid{i}", cfg, rng))
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{not json")
    (root / "list").mkdir()
    (root / "list" / "config.json").write_text("[1, 2]")
    (root / "empty-dir").mkdir()
    broken = [str(root / n / "config.json") for n in ("broken", "list")]
    broken += [str(root / "empty-dir"), str(root / "absent" / "config.json")]
    return paths[:24], paths[24:] + broken


def _write(folder: Path, cfg: dict, rng: random.Random) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder) if rng.random() < 0.5 else str(folder / "config.json")  # dir or file


def _argv(rng: random.Random, models: tuple[list[str], list[str]]) -> list[str]:
    """Weighted so that each outcome (accepted, refused, error) is common."""
    pick = rng.random
    valid, invalid = models
    model = rng.choice([*PRESETS] if pick() < 0.5 else valid if pick() < 0.7 else invalid)
    argv = ["plan", "--model", model if pick() < 0.99 else "no-such-model"]
    if pick() < 0.9:  # tp 1-16, mostly powers of two (which divide most I)
        tp = rng.choice([1, 2, 4, 8]) if pick() < 0.7 else rng.randint(1, 16)
        argv += ["-tp", str(tp) if pick() < 0.98 else rng.choice(BAD_INTS)]
    if pick() < 0.2:
        argv += ["--enable-expert-parallel"]
    if pick() < 0.15:
        argv += ["-ep", str(rng.choice([1, 2, 4, 8, 16, 3, 0]))]
    if pick() < 0.6:
        argv += ["--enable-lora"]
    if pick() < 0.5:
        argv += ["--max-loras", str(rng.choice([1, 4, 8, 64, 1, 4, 8, 64, 0, -3]))]
    if pick() < 0.6:
        argv += ["--max-lora-rank", str(rng.choice([1, 6, 8, 16, 64, 128, 129, 256, 100000, 0]))]
    if pick() < 0.3:
        argv += ["--fully-sharded-loras"]
    if pick() < 0.2:
        argv += ["--lora-target-modules", *rng.choice(TARGET_MODULES)]
    if pick() < 0.3:
        argv += ["--lora-add-inputs", rng.choice(["add", "overwrite", "both"])]
    if pick() < 0.4:
        argv += ["--dtype", rng.choice(["auto", "bfloat16", "bf16", "float16", "float32", "int4"])]
    if pick() < 0.6:
        argv += ["--moe-backend", rng.choice(BACKENDS)]
    if pick() < 0.9:
        argv += ["--device", rng.choice(DEVICES)]
    graphs = pick()
    argv += ["--cuda-graphs"] if graphs < 0.15 else ["--enforce-eager"] if graphs < 0.45 else []
    if pick() < 0.02:
        argv += ["--cuda-graphs", "--enforce-eager"]  # mutually exclusive
    if pick() < 0.5:
        argv += ["--json"]
    return argv


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exit_:  # argparse's usage errors (and nothing else may exit)
            code = exit_.code
        except Exception as exc:  # a traceback: the bug this test exists to find
            pytest.fail(f"moelora {' '.join(argv)} raised {exc!r}")
    return code, out.getvalue(), err.getvalue()


def _check_json(argv: list[str], code: int, out: str, err: str) -> dict:
    """docs/plan.md's meaning of each exit code, against the plan's own table."""
    doc = json.loads(out)  # exactly one document: trailing text would raise here
    requested = argv[argv.index("--moe-backend") + 1] if "--moe-backend" in argv else "auto"
    if code == 2:
        assert doc["verdict"] == "ERROR" and doc["accepted"] is False and doc["error"], doc
        assert doc["error"] in err, err  # the same message on stderr
        return doc
    accepts = {b["name"]: b["accepts"] for b in doc["backends"]}
    assert list(accepts) == list(REGISTRY)
    for backend in doc["backends"]:  # a backend accepts iff every one of its checks passes
        assert backend["accepts"] == all(c["ok"] for c in backend["checks"])
    runs = any(accepts.values()) if requested == "auto" else accepts[requested]
    if code == 0:
        assert runs and doc["accepted"] is True and doc["selected"] in REGISTRY, doc["verdict"]
        assert requested in ("auto", doc["selected"])  # honoured, never substituted
        # auto: the registry order, an interpreted backend after the native ones on a cpu
        cpu = doc["deployment"]["device_kind"] == "cpu"
        slow = {n: cpu and REGISTRY[n].capabilities.cpu_needs_interpreter for n in accepts}
        ranking = sorted(accepts, key=lambda n: slow[n])
        assert doc["selected"] == next(n for n in ranking if accepts[n]) or requested != "auto"
    else:
        assert code == 3 and not runs and doc["accepted"] is False and doc["selected"] is None
        assert doc["fix"] and "Fix:" in err
    return doc


def _check_text(code: int, out: str, err: str) -> None:
    lines = out.splitlines()
    if code == 2:
        assert out == "" and ("error:" in err or "expected" in err), err
    elif code == 0:
        assert lines[-1].startswith("verdict: ACCEPTED: ")
    else:
        assert lines[-1].startswith("verdict: REFUSED: ") and lines[-2].startswith("fix: ")
        assert "Fix:" in err


@pytest.fixture(scope="module")
def combinations(tmp_path_factory) -> list[list[str]]:
    rng = random.Random(17_4)  # fixed: a failure names its argv and reproduces
    models = _config_files(tmp_path_factory.mktemp("configs"), rng)
    return [_argv(rng, models) for _ in range(COMBINATIONS)]


def test_plan_over_random_flag_combinations(combinations, monkeypatch):
    monkeypatch.setattr(logging.getLogger("moelora.oracle"), "level", logging.WARNING)
    codes = {0: 0, 2: 0, 3: 0}
    for argv in combinations:
        code, out, err = _run(argv)
        assert code in codes, (argv, code)
        codes[code] += 1
        if "--json" in argv:
            _check_json(argv, code, out, err)
            continue
        _check_text(code, out, err)
        again = _run([*argv, "--json"])  # the table and the JSON agree
        assert again[0] == code, (argv, code, again[0])
        _check_json([*argv, "--json"], *again)
    assert min(codes.values()) >= 100, codes  # every outcome is exercised, not one alone


def test_a_handful_in_subprocesses(combinations, monkeypatch):
    """The same answers from the real command line: four combinations, each exit code once
    and --json for two of them (each subprocess imports torch: a few seconds)."""
    monkeypatch.setattr(logging.getLogger("moelora.oracle"), "level", logging.WARNING)
    wanted = {(0, False), (2, True), (3, False), (3, True)}
    picked: dict[tuple[int, bool], list[str]] = {}
    for argv in combinations:
        key = (_run(argv)[0], "--json" in argv)
        if key in wanted:
            picked.setdefault(key, argv)
        if len(picked) == len(wanted):
            break
    assert set(picked) == wanted, picked.keys()
    for (code, as_json), argv in picked.items():
        done = subprocess.run(
            [sys.executable, "-m", "moelora", *argv], capture_output=True, text=True, cwd=ROOT
        )
        assert done.returncode == code, (argv, done.stderr)
        assert "Traceback" not in done.stderr
        if as_json:
            _check_json(argv, code, done.stdout, done.stderr)
        else:
            _check_text(code, done.stdout, done.stderr)
