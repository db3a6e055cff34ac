"""benchmarks/lora_sweep_report.py on synthetic bench and peer JSON dicts: the peer set
beside a case only for the same layer and (adapters, rank) with every slot at the bank's
rank, and issue 19's derived ratios (padded vs small bank, mixed bank vs the rank-weighted
mix, x floor, +LoRA / LoRA-free, against the grouped GEMMs), missing cases left open."""

from __future__ import annotations

import json

import pytest

from benchmarks import lora_sweep_report as report
from moelora.bench.cases import BenchCase
from moelora.bench.peer import peer_shape

Q = "qwen3-30b-a3b"
MIXED = [8, 16, 64, 128, 8, 16, 64, 128]


def _row(tokens, adapters, rank, base, lora, ranks=None, floor=1.0) -> dict:
    """A bench row as moelora/bench/runner.py writes it (floor: the +LoRA floor, ms)."""
    ranks = ranks or [rank] * adapters
    case = BenchCase(Q, tokens, adapters, rank, ranks=tuple(ranks))
    side = lambda ms, floor_ms: dict(ms=ms, floor_ms=floor_ms, ok=True)  # noqa: E731
    return dict(case=case.id, model=Q, T=tokens, L=adapters, R=rank, ranks=ranks,
                base=side(base, floor / 1.03), lora=side(lora, floor), backend="triton")  # fmt: skip


def _peer(adapters: int, rank: int, lora_ms: dict[int, float], **shape) -> dict:
    want = {**peer_shape(BenchCase(Q, 1, adapters, rank)), **shape}
    rows = [dict(T=t, lora_pre_ms=ms, base_pre_ms=ms / 2) for t, ms in lora_ms.items()]
    return dict(shape=want, rows=rows, check_ok=True)


ROWS = [
    _row(4096, 8, 128, 1.0, 2.0, ranks=[8] * 8),  # rank 8 padded to R = 128
    _row(4096, 8, 8, 1.0, 1.6),
    _row(4096, 8, 16, 1.0, 1.2),
    _row(4096, 8, 64, 1.0, 1.4),
    _row(4096, 8, 128, 1.0, 1.5, floor=1.25),
    _row(4096, 8, 128, 1.0, 1.33, ranks=MIXED),  # LoRA costs .6 .2 .4 .5: mix .425
    _row(4096, 64, 16, 1.0, 1.1, floor=1.0),
    _row(16384, 8, 128, 4.0, 4.4, ranks=MIXED),  # no uniform banks at 16384: open
    dict(case=f"{Q}/T=256/L=8/R=256", T=256, backend="triton", refused="lora.max_rank"),
]
BENCH = dict(device="NVIDIA H200", torch="2.x", triton="3.x", commit="abc1234",
             time="2026-12-02T10:00:00", ceilings=dict(bandwidth_Bps=4.2e12, matmul_flops=7.8e14),
             rows=ROWS, complete=True)  # fmt: skip


def _goal(goals: list[dict], name: str, tokens: int) -> dict:
    (goal,) = [g for g in goals if g["target"].startswith(name) and g["T"] == tokens]
    return goal


def test_the_peer_sits_beside_uniform_banks_of_its_config_only() -> None:
    peers = [
        _peer(8, 128, {4096: 3.0}),  # beside 8 x 128, not beside the padded rank-8 bank
        _peer(64, 16, {4096: 2.5}),
        _peer(8, 16, {4096: 9.0}, H=4096),  # another layer: beside no case
    ]
    rows, unused = report.case_rows(BENCH, peers)
    vllm = {r["case"]: r.get("vllm_lora_ms") for r in rows}
    assert vllm[f"{Q}/T=4096/L=8/R=128"] == 3.0
    assert vllm[f"{Q}/T=4096/L=64/R=16"] == 2.5
    assert vllm[f"{Q}/T=4096/L=8/R=128/ranks=8"] is None
    assert vllm[f"{Q}/T=4096/L=8/R=16"] is None
    assert [p["shape"]["H"] for p in unused] == [4096]


def test_the_derived_ratios() -> None:
    rows, _ = report.case_rows(BENCH, [])
    goals = report.targets(rows)
    padded = _goal(goals, "bank R=128 of rank-8", 4096)
    assert padded["value"] == pytest.approx(2.0 / 1.6) and padded["met"] is False
    mixed = _goal(goals, "mixed bank", 4096)
    assert mixed["value"] == pytest.approx(0.33 / 0.425) and mixed["met"] is True
    assert _goal(goals, "mixed bank", 16384)["value"] is None  # its uniform banks missing
    assert _goal(goals, "8x128 +LoRA x floor", 4096)["value"] == pytest.approx(1.5 / 1.25)
    assert _goal(goals, "64x16 +LoRA x floor", 4096)["met"] is True
    assert _goal(goals, "64x16 +LoRA x floor", 256)["value"] is None  # not run
    over = [g for g in goals if g["target"] == "+LoRA / LoRA-free"]
    assert len(over) == 8  # every timed case at T >= 4096
    assert _goal(over, "+LoRA / LoRA-free", 16384)["value"] == pytest.approx(1.1)


def test_the_grouped_gemm_ceiling_ratios() -> None:
    rows, _ = report.case_rows(BENCH, [])
    gemm = dict(rows=[dict(T=4096, **{"grouped both": dict(ms=1.1)}), dict(T=1024)])
    goals = report.targets(rows, gemm)
    assert _goal(goals, "8x16 +LoRA / grouped", 4096)["value"] == pytest.approx(1.2 / 1.1)
    assert _goal(goals, "8x16 LoRA-free / grouped", 4096)["met"] is True


def test_the_markdown_and_main(tmp_path, capsys) -> None:
    bench, peer = tmp_path / "sweep.json", tmp_path / "vllm_peer_L8_R128.json"
    bench.write_text(json.dumps({**BENCH, "complete": False}))
    peer.write_text(json.dumps(_peer(8, 128, {4096: 3.0})))
    out = tmp_path / "sweep.md"
    report.main(["--bench", str(bench), "--peers", str(peer), "--out", str(out)])
    text = out.read_text()
    assert text == capsys.readouterr().out
    assert "| T=4096/L=8/R=128 | 1.000 | 1.500 | 1.500 | 1.250 | 1.20 | 3.000 | pass |" in text
    assert "| T=256/L=8/R=256 | refused: lora.max_rank |" in text
    assert "PARTIAL" in text and "abc1234" in text
