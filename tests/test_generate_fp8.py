"""`moelora generate --model DIR` on an FP8 checkpoint directory (block-scaled e4m3
experts, quantization_config as transformers writes it), with experts-only PEFT adapters:

- dequantized: transformers on a CPU dequantizes the experts and drops the config; the
  rows are checked against HF + PEFT on those weights, in fp32 (equal tokens).
- fp8-module: transformers made to keep its FP8Experts (as on a GPU >= sm89); moelora
  serves their e4m3 tensors, W8A8, and the rows are checked against the W8A8 truth
  (transformers' eager experts loop on quantized inputs, PEFT's delta weight on the
  unquantized rows). transformers' own FP8 kernels do not run on a CPU: no noise is
  measured, the FP8 table row is the tolerance.
The adapters' factors (std 0.1) move their rows' logits by far more than either tolerance
(0.6-0.9 relative, as benchmarks/fp8_generate.py measures at this size)."""

from __future__ import annotations

import json

import pytest

from benchmarks.fp8_checkpoint import write_fp8_checkpoint
from benchmarks.fp8_generate import TINY, write_adapters
from moelora.bench.qwen3_model import build
from moelora.cli import main

pytestmark = pytest.mark.filterwarnings("ignore")

# (id, transformers keeps FP8Experts, the check runs the W8A8 truth, q / k / v / o in FP8)
CASES = [
    ("dequantized", False, False, False),
    ("fp8-module", True, True, False),
    # the published checkpoints' layout: transformers keeps its FP8Linear projections too,
    # which moelora computes with its own kernel (transformers' come from the Hub)
    ("fp8-attention", True, True, True),
]


def _fp8_dir(tmp_path, seed: int, attention: bool = False):
    model = build(2, "cpu", seed, **TINY).float()
    adapters = write_adapters(model, tmp_path / "adapters", 2, 4, 0.1)
    write_fp8_checkpoint(model, tmp_path / "model", 32, "per_expert", attention=attention)
    return tmp_path / "model", adapters


@pytest.mark.parametrize("name,fp8_module,w8a8,attention", CASES, ids=[c[0] for c in CASES])
def test_generate_checks_rows_on_an_fp8_dir(tmp_path, capsys, monkeypatch, seed, name,
                                           fp8_module, w8a8, attention):  # fmt: skip
    model_dir, adapters = _fp8_dir(tmp_path, seed, attention)
    if fp8_module:
        from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

        monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda *a, **k: None)
    argv = ["generate", "--model", str(model_dir), "--max-new-tokens", "3", "--json",
            "--rows", "a0,base,a1", *(f"--adapter={n}={p}" for n, p in adapters.items())]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    check = doc["check"]
    assert doc["verdict"].startswith("PASS"), doc["verdict"]
    assert (check["hf_experts_implementation"] == "moelora_w8a8_truth") == w8a8, check
    assert ("equal tokens" in check["tolerance_rule"]) != fp8_module, check  # fp32 only
    tol = check["logits_rel_tol"]
    assert tol == (3e-2 if fp8_module else 1e-5), check
    rows = doc["rows"]
    assert [r["adapter"] for r in rows] == ["a0", None, "a1"]
    assert all(r["logits_rel_err"] <= tol for r in rows), rows  # NaN fails
    if not fp8_module:  # fp32 sums on both sides: equal tokens
        assert all(r["first_different_step"] is None for r in rows), rows
