"""`moelora serve` / `moelora run-batch` refusals a user meets before anything serves: each
exits 2 with a message naming the flag or package and the fix (no traceback)."""

from __future__ import annotations

import importlib.util

import pytest
import serve_fixtures as sf

from moelora.cli import main

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return sf.build(tmp_path_factory.mktemp("cli"), seed=11).root / "model"


def _no_tokenizer(tmp_path, model_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((model_dir / "config.json").read_text())
    return bare


CASES = [
    # (id, argv after the model dir (None: a dir without a tokenizer), words in the error)
    ("lora-modules-not-name-eq-dir", ["--lora-modules", "oops"], ["--lora-modules", "NAME=DIR"]),
    ("lora-module-not-an-adapter", ["--lora-modules", "a=/nowhere"], ["adapter_config.json"]),
    (
        "kv-budget-on-a-cpu",
        ["--gpu-memory-utilization", "0.9"],
        ["--gpu-memory-utilization", "CPU"],
    ),
    ("no-tokenizer", None, ["MODEL_DIR", "tokenizer"]),
    # the package names the keyword num_slots / max_rank; the user typed vLLM's flag
    ("max-loras-zero", ["--max-loras", "0"], ["'--max-loras' = 0", "positive"]),
    ("max-lora-rank-zero", ["--max-lora-rank", "0"], ["'--max-lora-rank' = 0", "positive"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_refusals_name_the_flag_and_exit_2(case, model_dir, tmp_path, capsys):
    _, argv, words = case
    root = _no_tokenizer(tmp_path, model_dir) if argv is None else model_dir
    code = main(["serve", str(root), "--moe-backend", "reference", *(argv or [])])
    err = capsys.readouterr().err
    assert code == 2 and all(w in err for w in words), err


def test_a_model_dir_without_config_is_refused(tmp_path, capsys):
    code = main(["run-batch", str(tmp_path), "-i", str(tmp_path / "none.jsonl"), "-o", "x"])
    assert code == 2 and "--input-file" in capsys.readouterr().err
    (tmp_path / "in.jsonl").write_text("\n")
    code = main(["run-batch", str(tmp_path), "-i", str(tmp_path / "in.jsonl"), "-o", "x"])
    assert code == 2 and "config.json" in capsys.readouterr().err


def test_without_the_serve_extra_it_says_what_to_install(model_dir, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "fastapi" else real(n, *a)
    )
    assert main(["serve", str(model_dir)]) == 2
    err = capsys.readouterr().err
    assert "fastapi" in err and "pip install 'moelora[serve]'" in err
