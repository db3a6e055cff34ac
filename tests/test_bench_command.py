"""`moelora bench`'s case loop without a GPU (selection and timing stood in for): a case the
oracle refuses becomes a row naming why and the sweep goes on; the rows are saved after
every case, so a run stopped by its time limit keeps what it timed."""

from __future__ import annotations

import argparse

import moelora.bench.runner as runner
import moelora.commands.bench as bench
from moelora.bench.cases import BenchCase
from moelora.errors import UnsupportedDeploymentError

Q = "qwen3-30b-a3b"


def test_a_refused_case_is_a_row_and_the_sweep_goes_on(monkeypatch) -> None:
    def select(name: str, case: BenchCase):
        if case.max_rank > 128:
            raise UnsupportedDeploymentError(name, {name: ["lora.max_rank = 256"]}, [])
        return name

    timed = lambda backend, case, ceil, iters, cache: dict(case=case.id, T=case.tokens)  # noqa: E731
    monkeypatch.setattr(bench, "select_backend", select)
    monkeypatch.setattr(runner, "run_case", timed)
    cases = [BenchCase(Q, 256, 8, 256), BenchCase(Q, 256, 8, 16)]
    saved: list[tuple[int, bool]] = []
    args = argparse.Namespace(backends="triton", iters=1)
    rows = bench._run_cases(
        args, cases, None, {}, lambda r, complete: saved.append((len(r), complete))
    )
    assert "lora.max_rank = 256" in rows[0]["refused"] and rows[0]["case"] == cases[0].id
    assert rows[1] == dict(case=cases[1].id, T=256, backend="triton")
    assert saved == [(1, False), (2, False)]


def test_select_cases_by_tokens_and_id_pieces() -> None:
    from moelora.bench.cases import CASES
    from moelora.commands.bench import select_cases

    sweep = CASES["lora-sweep"]
    got = select_cases(sweep, None, "R=256,T=4096/L=8/R=128/ranks=8")
    assert {c.id for c in got} == {
        "qwen3-30b-a3b/T=256/L=8/R=256",
        "qwen3-30b-a3b/T=4096/L=8/R=256",
        "qwen3-30b-a3b/T=4096/L=8/R=128/ranks=8",
        "qwen3-30b-a3b/T=4096/L=8/R=128/ranks=8,16,64,128,8,16,64,128",  # a piece, not a whole id
    }
    assert [c.id for c in select_cases(sweep, (256,), "R=256")] == ["qwen3-30b-a3b/T=256/L=8/R=256"]
    assert select_cases(sweep, None, None) == sweep
    assert select_cases(sweep, (3,), None) == []
