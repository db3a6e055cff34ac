"""`moelora generate`, the README's main job: the default run (a random model, four PEFT
adapters, a mixed left-padded batch, each row checked against HF + PEFT alone), a user's
model directory with adapter directories, and its refusals."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hf_models import build_family

from moelora.cli import main
from moelora.commands.generate import DEFAULT_ROWS

ROOT = Path(__file__).resolve().parents[1]


def moelora(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m moelora ARGV` as a user runs it (no TRITON_INTERPRET preset)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", "moelora", *argv],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout,
    )  # fmt: skip


pytestmark = pytest.mark.filterwarnings("ignore")


ROW = re.compile(r"^\s+\d+\s+\S+\s+\d+\s+(equal tokens|tokens differ)")


def test_default_run_checks_every_row_against_hf_peft(capsys):
    assert main(["generate", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if ROW.match(line)]
    assert len(rows) == 5 and all("equal tokens, logits rel err" in r for r in rows), out
    assert {"base", "fused-r4-attn", "modules-r4"} <= {r.split()[1] for r in rows}
    assert out.count("new tokens: [") == 5, out
    assert "verdict: PASS" in out and "and equal tokens" in out
    # On a CPU, auto ranks the interpreted triton backend below the reference, and says so.
    assert "selected reference, auto" in out and "triton would run interpreted" in out
    # modules-r4 is r = 4 on disk and rank 8 loaded: the line says why.
    assert "adapter modules-r4: rank 8 (r = 4 in adapter_config.json; rank_pattern" in out


def test_bf16_runs_and_judges_logits_against_hf_noise_measured_in_the_run():
    # transformers' grouped_mm refuses these bf16 strides on a CPU: the check must pick an
    # implementation that runs, print HF's own noise, and derive the tolerance from it.
    done = moelora("generate", "--dtype", "bf16", "--max-new-tokens", "4")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == "", done.stderr  # no traceback, warning or log line
    out = done.stdout
    assert "experts implementation" in out and "grouped_mm experts" not in out, out
    assert "HF's own noise, batched_mm vs eager experts: prompt logits rel err" in out
    assert "HF's own noise, batched_mm vs HF in float32: prompt logits rel err" in out
    noise = max(float(v) for v in re.findall(r"noise, .*rel err (\S+) \(largest", out))
    tol = float(re.search(r"within tol (\S+) = max\(bfloat16 table 1\.0e-02, 2 x HF", out)[1])
    assert tol == pytest.approx(max(1e-2, 2 * noise), rel=0.06), out
    errs = [float(v) for v in re.findall(r"logits rel err (\S+)$", out, re.M)]
    assert len(errs) == 5 and max(errs) <= tol, out
    assert "largest logits rel err: row" in out


def test_json_prints_whole_rows_and_the_check(capsys):
    assert main(["generate", "--max-new-tokens", "5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"].startswith("PASS") and doc["exit_code"] == 0
    assert doc["backend"] == "reference" and doc["interpreted"] is False
    assert [r["adapter"] for r in doc["rows"]] == DEFAULT_ROWS
    for row in doc["rows"]:
        assert len(row["new_tokens"]) == 5 and row["new_tokens"] == row["hf_peft_new_tokens"]
        assert row["first_different_step"] is None and 0 <= row["logits_rel_err"] <= 1e-5
    assert doc["check"]["logits_rel_tol"] == 1e-5 and doc["check"]["hf_noise"] == []


def test_explicit_triton_on_a_cpu_is_honoured_and_says_interpreted(capsys):
    assert main(["generate", "--max-new-tokens", "1", "--moe-backend", "triton"]) == 0
    out = capsys.readouterr().out
    assert "selected triton (interpreted: Triton's CPU interpreter, slow), requested" in out
    assert "verdict: PASS" in out


def test_a_model_directory_in_bf16_with_short_adapter_names(tmp_path):
    # PEFT warns about adapter names contained in its "lora_" prefix ("a", "lora"): the
    # HF + PEFT check loads them under neutral names, so a user sees nothing to ignore. In
    # bf16 the check also builds HF in fp32 beside the PEFT model (the noise measure).
    family = build_family("qwen3_moe", tmp_path / "adapters", seed=3)
    family.base.save_pretrained(tmp_path / "model")
    done = moelora(
        "generate", "--model", str(tmp_path / "model"), "--max-new-tokens", "2", "--dtype", "bf16",
        "--adapter", f"a={family.dirs['fused-r8']}", "--adapter", f"lora={family.dirs['fused-r2']}",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "should not be contained in the prefix" not in done.stderr, done.stderr
    assert done.stderr == "", done.stderr  # no warning, progress bar or log line to ignore
    assert len(re.findall(r"tokens.*, logits rel err", done.stdout)) == 3, done.stdout
    assert "HF's own noise, batched_mm vs HF in float32" in done.stdout
    assert "verdict: PASS: every row within tol" in done.stdout, done.stdout


def test_a_model_directory_with_named_adapters(tmp_path, capsys, seed):
    family = build_family("mixtral", tmp_path / "adapters", seed=seed % 997)
    family.base.save_pretrained(tmp_path / "model")
    args = ["generate", "--model", str(tmp_path / "model"), "--max-new-tokens", "2",
            "--moe-backend", "reference", "--rows", "fused-r8,base,fused-r4-attn"]  # fmt: skip
    for name in ("fused-r8", "fused-r4-attn"):
        args += ["--adapter", f"{name}={family.dirs[name]}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("equal tokens, logits") == 3 and "verdict: PASS" in out, out


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
    assert out.count("equal tokens, logits") == 2 and "verdict: PASS" in out


CASES = [
    # (id, argv, exit code, words in the error)
    ("adapter-without-model", ["--adapter", "a=/nowhere"], 2, ["--adapter", "--model"]),
    ("adapter-not-name-eq-dir", ["--model", ".", "--adapter", "oops"], 2, ["NAME=DIR"]),
    # the same NAME twice: the second would silently replace the first
    ("adapter-name-twice", ["--model", ".", "--adapter", "x=/a", "--adapter", "x=/b"], 2,
     ["'--adapter' = 'x=/b'", "each NAME once", "'x' is already /a", "Fix: give each"]),
    ("unknown-row", ["--rows", "fused-r8,nope"], 2, ["--rows", "nope"]),
    ("model-without-config", ["--model", "/nowhere"], 2, ["--model", "config.json"]),
    ("prompt-without-tokenizer", ["--prompt", "hello"], 2, ["--prompt", "tokenizer"]),
    # the toy's max_position_embeddings is 128; its longest random prompt 11 tokens
    ("past-the-positions", ["--max-new-tokens", "200"], 2,
     ["'--max-new-tokens' = 200", "at most 117", "max_position_embeddings (128)",
      "Fix: --max-new-tokens 117"]),
    # grouped_mm is CUDA-only: the fix names only flags generate has
    ("backend-that-refuses-here", ["--moe-backend", "grouped_mm"], 3,
     ["grouped_mm: device.kind = cpu", "Fix: use --moe-backend reference (or auto)"]),
    # the toy's adapters are natural: read swapped, no shape fits
    ("fused-orientation-passed-on", ["--fused-orientation", "swapped"], 2,
     ["adapter file", "named by fused_orientation", "Fix: --fused-orientation natural"]),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_refusals_name_the_flag(case, capsys):
    _, argv, want, words = case
    code = main(["generate", "--max-new-tokens", "1", *argv])
    err = capsys.readouterr().err
    assert code == want, err
    assert all(w in err for w in words), err
    assert "--device" not in err and "--enforce-eager" not in err, err


def test_no_check_says_so(capsys):
    assert main(["generate", "--max-new-tokens", "1", "--no-check"]) == 0
    assert "no comparison ran" in capsys.readouterr().out


def test_fused_orientation_flag_settles_an_ambiguous_adapter(tmp_path, capsys):
    # OLMoE's own proportion H = 2 I (here 32 = 2 x 16): a fused gate_up_proj factor pair
    # (alone: down_proj's would settle it) reads both ways. With no peft_version in its config, the file cannot tell: refused, and
    # the fix names generate's flag; with the flag it loads and equals HF + PEFT.
    import json as json_

    from moelora.hf import toy

    base = toy.build_model("olmoe", seed=4, intermediate_size=16)
    base.save_pretrained(tmp_path / "model")
    adapter = tmp_path / "fused"
    toy.write_peft_adapter(
        base, adapter, seed=5, r=4, target_parameters=toy.expert_parameters(base)[:1]
    )
    config = json_.loads((adapter / "adapter_config.json").read_text())
    config.pop("peft_version", None)
    (adapter / "adapter_config.json").write_text(json_.dumps(config))
    argv = ["generate", "--model", str(tmp_path / "model"), "--adapter", f"x={adapter}",
            "--max-new-tokens", "2", "--moe-backend", "reference"]  # fmt: skip
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Fix: --fused-orientation natural (PEFT >= 0.19.1 saves it so) or swapped" in err, err
    assert "fused_orientation=" not in err, err
    assert main([*argv, "--fused-orientation", "natural"]) == 0
    out = capsys.readouterr().out
    assert out.count("equal tokens, logits") == 2 and "verdict: PASS" in out, out
