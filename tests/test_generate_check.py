"""`moelora generate`'s verdict rule and its input refusals, GPU-free and without a model:
case tables over the functions the command calls (the command itself runs in
tests/test_generate_cli.py; its fix lines in tests/test_command_fixes.py)."""

from __future__ import annotations

import pytest
import torch

from moelora.commands.generate.check import RowCheck, verdict
from moelora.commands.generate.inputs import check_positions
from moelora.errors import ConfigError
from moelora.truth.hf_peft import Noise

BF16, FP32 = torch.bfloat16, torch.float32
SAME = [5, 6, 7, 8]
NOISE = [Noise("batched_mm vs eager experts", 0.0, 0, None),
         Noise("batched_mm vs HF in float32", 0.011, 1, "a")]  # fmt: skip

# (id, dtype, HF noise, rows as (name, new tokens, logits rel err), ok, words in the verdict)
VERDICTS = [
    ("fp32-equal-passes", FP32, [], [("a", SAME, 3e-7), (None, SAME, 1e-7)], True,
     ["PASS: every row within tol 1.0e-05 (float32 table) and equal tokens",
      "largest logits rel err: row 0 a at 3.0e-07"]),
    # fp32 holds tokens: both sides compute exactly, a flipped token is a bug
    ("fp32-token-differs-fails", FP32, [], [("a", SAME, 3e-7), ("b", [5, 6, 9, 8], 4e-7)],
     False, ["FAIL: row 1 b (tokens differ from step 2)"]),
    ("fp32-logits-over-fail", FP32, [], [("a", SAME, 2e-5)], False,
     ["FAIL: row 0 a (logits rel err 2.0e-05 > 1.0e-05)"]),
    # bf16: two correct implementations part after a few tokens; only the logits decide
    ("bf16-token-differs-passes", BF16, NOISE, [("a", [5, 6, 9, 9], 1.2e-2)], True,
     ["PASS: every row within tol 2.2e-02 = max(bfloat16 table 1.0e-02, 2 x HF's own noise "
      "1.1e-02)", "row 0 a at 1.2e-02"]),
    ("bf16-over-the-calibrated-tol-fails", BF16, NOISE,
     [("a", SAME, 1e-2), (None, SAME, 3e-2), ("c", SAME, 2.5e-2)], False,
     ["FAIL: row 1 base (logits rel err 3.0e-02 > 2.2e-02), row 2 c (logits rel err 2.5e-02"]),
    # no noise measured above the table: the table decides
    ("bf16-quiet-hf-keeps-the-table", BF16, NOISE[:1], [("a", SAME, 1.2e-2)], False,
     ["row 0 a (logits rel err 1.2e-02 > 1.0e-02)", "2 x HF's own noise 0.0e+00"]),
    ("nan-never-passes", BF16, NOISE, [("a", SAME, float("nan"))], False,
     ["FAIL: row 0 a (logits rel err nan"]),
    # a NaN noise must not widen (or poison) the tolerance
    ("nan-noise-adds-nothing", BF16, [Noise("x", float("nan"), 0, None)], [("a", SAME, 5e-3)],
     True, ["tol 1.0e-02 = max(bfloat16 table 1.0e-02"]),
]  # fmt: skip


@pytest.mark.parametrize("case", VERDICTS, ids=[c[0] for c in VERDICTS])
def test_verdict_names_the_rows_and_values_that_decided_it(case):
    _, dtype, noise, rows, ok, words = case
    checks = [RowCheck(i, name, new, SAME, err) for i, (name, new, err) in enumerate(rows)]
    out = verdict(checks, dtype, noise)
    assert out.ok == ok, out.text
    assert all(w in out.text for w in words), out.text


class _Config:
    max_position_embeddings = 16


# (id, prompt lengths, max new tokens, field, fix); None: accepted
POSITIONS = [
    ("fits-exactly", [4, 10], 6, None, None),
    ("prompt-alone-too-long", [17, 3], 1, "--prompt", "shorten the prompt"),
    ("with-new-tokens-too-long", [4, 10], 7, "--max-new-tokens", "--max-new-tokens 6"),
]  # fmt: skip


@pytest.mark.parametrize("case", POSITIONS, ids=[c[0] for c in POSITIONS])
def test_positions_past_the_model_are_refused(case):
    _, lengths, new, field, fix = case
    prompts = [torch.randint(1, 50, (n,)) for n in lengths]
    if field is None:
        check_positions(prompts, new, _Config())
        return
    with pytest.raises(ConfigError) as err:
        check_positions(prompts, new, _Config())
    assert err.value.key == field and fix in err.value.fix
    assert "max_position_embeddings" in str(err.value) and "16" in str(err.value)
