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
    # counts, lengths, ports and times out of range: refused while the flags are parsed
    ("max-loras-zero", ["--max-loras", "0"], ["--max-loras", "'0'", ">= 1"]),
    ("max-lora-rank-zero", ["--max-lora-rank", "0"], ["--max-lora-rank", ">= 1"]),
    ("max-num-seqs-negative", ["--max-num-seqs", "-3"], ["--max-num-seqs", ">= 1"]),
    ("max-model-len-one", ["--max-model-len", "1"], ["--max-model-len", ">= 2"]),
    ("max-num-batched-tokens-zero", ["--max-num-batched-tokens", "0"],
     ["--max-num-batched-tokens", ">= 1"]),
    ("port-out-of-range", ["--port", "99999"], ["--port", "1..65535"]),
    ("negative-shutdown-timeout", ["--shutdown-timeout", "-1"], ["--shutdown-timeout"]),
    ("negative-stall-dump-seconds", ["--stall-dump-seconds", "-1"],
     ["--stall-dump-seconds", "'-1'", "[0, 1e6]"]),
    ("stall-dump-seconds-nan", ["--stall-dump-seconds", "nan"], ["--stall-dump-seconds", "'nan'"]),
    ("utilization-above-one", ["--gpu-memory-utilization", "1.5"], ["(0, 1]"]),
    # past the model's 128 positions (build's default): vLLM refuses it too
    ("max-model-len-past-positions", ["--max-model-len", "1024"],
     ["--max-model-len", "1024", "max_position_embeddings (128)"]),
    ("same-adapter-name-twice", ["--lora-modules", "a=/x", "a=/y"], ["'a' twice", "own name"]),
    ("lora-modules-bad-json", ["--lora-modules", '{"name": "a"'], ["--lora-modules", "JSON"]),
    ("lora-modules-json-no-path", ["--lora-modules", '{"name": "a"}'], ["base_model_name"]),
    ("chat-template-missing-file", ["--chat-template", "./no/such.jinja"], ["--chat-template"]),
    ("chat-template-bad-jinja", ["--chat-template", "{% for %}"], ["--chat-template", "line 1"]),
    ("allowed-root-missing", ["--allowed-local-lora-path", "/no/such/dir"],
     ["--allowed-local-lora-path", "an existing directory"]),
    # vLLM flags with no meaning here: refused with the reason, not "unrecognized"
    ("vllm-tp", ["-tp", "2"], ["-tp", "one GPU"]),
    ("vllm-trust-remote-code", ["--trust-remote-code"], ["--trust-remote-code", "own classes"]),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_refusals_name_the_flag_and_exit_2(case, model_dir, tmp_path, capsys):
    _, argv, words = case
    root = _no_tokenizer(tmp_path, model_dir) if argv is None else model_dir
    try:
        port = ["--port", str(sf.free_port())]  # serve binds it before the model loads
        code = main(["serve", str(root), "--moe-backend", "reference", *port, *(argv or [])])
    except SystemExit as usage:  # argparse's refusal: exit 2 with its usage line
        code = usage.code
    err = capsys.readouterr().err
    assert code == 2 and all(w in err for w in words), err
    assert "Traceback" not in err


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
    assert main(["serve", str(model_dir), "--port", str(sf.free_port())]) == 2
    err = capsys.readouterr().err
    assert "fastapi" in err and "pip install 'moelora[serve]'" in err
