"""`moelora generate`, the README's main job: the default run (a random model, four PEFT
adapters, a mixed left-padded batch, each row checked against HF + PEFT alone), a user's
model directory with adapter directories, and its refusals."""

from __future__ import annotations

import re

import pytest
from hf_models import build_family

from moelora.cli import main

pytestmark = pytest.mark.filterwarnings("ignore")


def test_default_run_checks_every_row_against_hf_peft(capsys):
    assert main(["generate", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"^\s+\d+\s+\S+\s+\d+\s+\[", line)]
    assert len(rows) == 5 and all("equal" in r for r in rows), out
    assert {"base", "fused-r4-attn", "modules-r4"} <= {r.split()[1] for r in rows}
    assert "verdict: PASS" in out and "selected triton" in out


def test_a_model_directory_with_named_adapters(tmp_path, capsys, seed):
    family = build_family("mixtral", tmp_path / "adapters", seed=seed % 997)
    family.base.save_pretrained(tmp_path / "model")
    args = ["generate", "--model", str(tmp_path / "model"), "--max-new-tokens", "2",
            "--moe-backend", "reference", "--rows", "fused-r8,base,fused-r4-attn"]  # fmt: skip
    for name in ("fused-r8", "fused-r4-attn"):
        args += ["--adapter", f"{name}={family.dirs[name]}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("equal") == 3 and "verdict: PASS" in out, out


def _word_tokenizer(vocab_size: int):
    """A word-level tokenizer over "w0 .. wN" (no download): what a user's model dir holds."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>")


def test_prompts_through_the_model_directorys_tokenizer(tmp_path, capsys):
    family = build_family("qwen3_moe", tmp_path / "adapters", seed=5)
    family.base.save_pretrained(tmp_path / "model")
    _word_tokenizer(family.base.config.vocab_size).save_pretrained(tmp_path / "model")
    args = ["generate", "--model", str(tmp_path / "model"), "--max-new-tokens", "2",
            "--moe-backend", "reference", "--rows", "fused-r4-attn,base",
            "--adapter", f"fused-r4-attn={family.dirs['fused-r4-attn']}",
            "--prompt", "w5 w7 w9", "--prompt", "w1 w2"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "'w5 w7 w9' -> 'w" in out and "'w1 w2' -> 'w" in out, out
    assert out.count("equal") == 2 and "verdict: PASS" in out


CASES = [
    # (id, argv, words in the error)
    ("adapter-without-model", ["--adapter", "a=/nowhere"], ["--adapter", "--model"]),
    ("adapter-not-name-eq-dir", ["--model", ".", "--adapter", "oops"], ["NAME=DIR"]),
    ("unknown-row", ["--rows", "fused-r8,nope"], ["--rows", "nope"]),
    ("model-without-config", ["--model", "/nowhere"], ["--model", "config.json"]),
    ("prompt-without-tokenizer", ["--prompt", "hello"], ["--prompt", "tokenizer"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_refusals_name_the_flag(case, capsys):
    _, argv, words = case
    code = main(["generate", "--max-new-tokens", "1", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert all(w in err for w in words), err


def test_no_check_says_so(capsys):
    assert main(["generate", "--max-new-tokens", "1", "--no-check"]) == 0
    assert "no comparison ran" in capsys.readouterr().out
