"""`moelora validate --dtype`: the same cases in another dtype, judged by that dtype's
tolerance; `--rank`; `--lora-sweep`: the LoRA sweep's banks added; `--suite ranks`: banks
with garbage past each slot's rank (the interpreter on CPU with the tiny preset here; a
GPU runs the real shapes)."""

from __future__ import annotations

import pytest

from moelora import cli
from moelora.cli import build_parser
from moelora.commands.validate.cases import LORA_SWEEP_TOKENS, lora_sweep_cases, ranks_cases


@pytest.mark.parametrize("dtype,tol", [("fp32", "1e-05"), ("fp16", "2e-03")])
def test_validate_runs_in_the_requested_dtype(dtype, tol, capsys) -> None:
    args = ["--device", "cpu", "--models", "tiny", "--tokens", "3", "--quick", "--dtype", dtype]
    code = cli.main(["validate", *args])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("triton")]
    assert code == 0 and "validate: 1/1 passed" in out
    header = next(line for line in out.splitlines() if line.startswith("backend"))
    assert header.split()[3:6] == ["rel_err", "rel_tol", "max_abs"], header
    assert len(rows) == 1 and rows[0].split()[-4] == tol and " pass " in rows[0], rows


def test_validate_rank_sets_the_sweep_rank(capsys) -> None:
    args = ["--device", "cpu", "--models", "tiny", "--tokens", "3,5", "--quick", "--rank", "32"]
    code = cli.main(["validate", *args, "--dtype", "fp32"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("triton")]
    assert code == 0 and "validate: 2/2 passed" in out
    assert len(rows) == 2 and all("L=8 R=32" in r and " pass" in r for r in rows)
    assert cli.main(["validate", "--device", "cpu", "--models", "tiny", "--rank", "0"]) == 2


def test_validate_refuses_an_unknown_dtype(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["validate", "--device", "cpu", "--models", "tiny", "--dtype", "fp8"])
    assert exc.value.code == 2 and "fp8" in capsys.readouterr().err


def test_lora_sweep_adds_the_sweep_banks() -> None:
    # (adapters, bank R, each slot's real rank or None = alternating R and R/2)
    banks = {(c.adapters, c.rank, c.ranks) for c in lora_sweep_cases()}
    assert banks == {
        (8, 128, (8, 16, 64, 128) * 2),  # mixed real ranks in one bank
        (8, 128, (8,) * 8),  # every slot padded from rank 8 to R = 128
        (64, 16, None),
        (128, 16, None),
        (8, 256, None),
    }
    assert {c.tokens for c in lora_sweep_cases()} == set(LORA_SWEEP_TOKENS)
    assert not any(c.graphs for c in lora_sweep_cases())
    assert not build_parser().parse_args(["validate"]).lora_sweep  # off unless asked


def test_lora_sweep_runs_on_tiny_shapes(capsys) -> None:
    """The sweep's banks built and checked on the CPU (tiny preset, T capped at 2: one token
    with an adapter): every bank the backend accepts passes; rank 256 is listed either way
    (refused where the backend's record says at most 128)."""
    args = ["--device", "cpu", "--models", "tiny", "--tokens", "2", "--quick", "--lora-sweep"]
    cli.main(["validate", *args, "--dtype", "fp32"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("triton")]
    assert len(rows) == 1 + len(lora_sweep_cases()) // len(LORA_SWEEP_TOKENS)
    assert any("R=128 ranks=8,16,64,128,8,16,64,128" in r for r in rows)
    assert all(" pass " in r for r in rows if "R=256" not in r)
    assert any("R=256" in r for r in rows)


def test_the_ranks_suite_runs_garbage_banks_against_the_clean_reference(capsys) -> None:
    """--suite ranks on the CPU (tiny preset, T 1 and capped at 3, eager): each bank's padded
    columns hold garbage, and every row passes against the reference on the clean bank."""
    banks = {(c.rank, c.ranks) for c in ranks_cases()}
    assert all(c.garbage for c in ranks_cases()) and len(banks) == 5
    assert {c.graphs for c in ranks_cases()} == {False, True}
    args = ["--device", "cpu", "--models", "tiny", "--tokens", "3", "--quick", "--suite", "ranks"]
    code = cli.main(["validate", *args, "--dtype", "fp32"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("triton") and "garbage" in line]
    capped = {(c.rank, c.ranks, min(c.tokens, 3)) for c in ranks_cases()}  # T 1 and 3 a bank
    assert len(rows) == len(capped) and all(" pass " in r for r in rows), rows
    assert code == 0


def test_padding_garbage_fails_a_computation_that_reads_past_the_rank() -> None:
    """The garbage is visible: the reference run on the garbage bank with the ranks
    ignored (every slot at full R) differs from the clean bank's output by far more than
    any tolerance, so a kernel that read past a rank would fail the suite."""
    import dataclasses

    import torch

    from moelora.commands.validate.table import with_dtype
    from moelora.compare import compare
    from moelora.inputs import build_bank, build_experts, build_inputs, with_padding_garbage
    from moelora.presets import resolve_model
    from moelora.reference import moe_lora_reference

    model = with_dtype(resolve_model("tiny"), "fp32")
    experts = build_experts(model, "cpu", 0)
    clean = build_bank(model, (4, 8), 8, "cpu")
    dirty = with_padding_garbage(clean)
    x, ids, w, slots = build_inputs(model, 6, 2, "cpu", 1)
    ref = moe_lora_reference(x, ids, w, slots, experts, clean, model.shape)
    same = moe_lora_reference(x, ids, w, slots, experts, dirty, model.shape)
    assert compare(same, ref, torch.float32).ok  # honouring the ranks: the same adapters
    full = dataclasses.replace(dirty, ranks=torch.full_like(dirty.ranks, 8))
    assert not compare(
        moe_lora_reference(x, ids, w, slots, experts, full, model.shape), ref, torch.float32
    ).ok
