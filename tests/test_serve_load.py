"""The load benchmark (benchmarks/serve_load.py) end to end on the tiny model: a real
`moelora serve --load-format dummy` process, the official `openai` client, one level's
LoRA-free and adapter runs on the same arrivals and the long-prompt scenario; the JSON has
every field, the counts add up and the latencies are ordered. Its workload's pieces
(benchmarks/serve_workload.py) and /metrics reader as case tables."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import serve_load, serve_load_report
from benchmarks.serve_load_report import (
    COPIES,
    EVICTIONS,
    PREEMPTIONS,
    PREFIX_HITS,
    PREFIX_QUERIES,
    counters,
    server_counts,
)
from benchmarks.serve_workload import Lengths, Shape, Workload, arrivals, popularity

ROOT = Path(__file__).resolve().parent.parent

LENGTHS = [
    # (id, spec, shape, low, high): the form each covers
    ("fixed", "fixed:7", Shape.FIXED, 7, 7),
    ("uniform", "uniform:4:12", Shape.UNIFORM, 4, 12),
    ("uniform-one-value", "uniform:5:5", Shape.UNIFORM, 5, 5),  # LO == HI
    ("lognormal", "lognormal:64:0.8:128", Shape.LOGNORMAL, 64, 128),  # clipped at MAX
]

REFUSED = [
    # (id, spec): why it is refused
    ("unknown-shape", "normal:3:1"),
    ("low-above-high", "uniform:12:4"),
    ("zero-length", "fixed:0"),
    ("missing-part", "uniform:4"),
    ("median-above-max", "lognormal:200:0.5:100"),
    ("not-a-number", "fixed:many"),
]


@pytest.mark.parametrize("case", LENGTHS, ids=[c[0] for c in LENGTHS])
def test_lengths_parse_and_draw_within_bounds(case, seed):
    _, spec, shape, low, high = case
    out = Lengths.parse(spec, "--prompt-len")
    assert (out.shape, out.low, out.high) == (shape, low, high)
    draws = [out.draw(random.Random(seed + i)) for i in range(300)]
    assert all(1 <= d <= high for d in draws)
    if shape is not Shape.LOGNORMAL:
        assert min(draws) >= low
    assert draws == [out.draw(random.Random(seed + i)) for i in range(300)]  # seeded


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_bad_lengths_are_refused_naming_the_flag_and_the_forms(case):
    with pytest.raises(ValueError, match="--output-len") as err:
        Lengths.parse(case[1], "--output-len")
    assert "uniform:LO:HI" in str(err.value) or ">= 1" in str(err.value)


def test_zipf_popularity_favours_the_first_names_and_zero_is_uniform(seed):
    assert popularity(4, 0.0) == [0.25] * 4
    weights = popularity(32, 1.0)
    assert abs(sum(weights) - 1) < 1e-12 and weights == sorted(weights, reverse=True)
    assert weights[0] / weights[1] == pytest.approx(2.0)  # (i + 1)^-1
    names = tuple(f"lora{i}" for i in range(32))
    work = Workload(8.0, Lengths.parse("fixed:3", "p"), Lengths.parse("uniform:1:4", "o"),
                    names, 1.0, 100)  # fmt: skip
    plan = arrivals(work, 2000, random.Random(seed))
    drawn = collections.Counter(a.adapter for a in plan)
    assert drawn.most_common(1)[0][0] == "lora0" and drawn["lora0"] > 3 * drawn["lora7"]
    assert [a.at for a in plan] == sorted(a.at for a in plan) and plan[0].at == 0.0
    assert plan == arrivals(work, 2000, random.Random(seed))  # the two runs' arrivals


def test_metrics_counters_sum_label_sets_and_leave_absent_families_out():
    text = (f"# TYPE {COPIES} counter\n{COPIES} 3\n{EVICTIONS} 1.0\n"
            'vllm:num_requests_running{model_name="base"} 2\n'
            f'{PREEMPTIONS}{{engine="0"}} 2\n{PREEMPTIONS}{{engine="1"}} 5\n')  # fmt: skip
    assert counters(text) == {COPIES: 3.0, EVICTIONS: 1.0, PREEMPTIONS: 7.0}


PAGED = {"paged": True, "blocks": 64, "block_size": 16, "prefix_caching": True}
SLAB = {"paged": False, "rows": 8, "positions": 512}
COUNTS = [
    # (id, /metrics after (before: all 0), the server's KV cache, preemptions, its note's
    # words, hit rate, the rate note's words): each reason a number is 0 or missing
    ("paged-hits", {PREEMPTIONS: 3, PREFIX_HITS: 32, PREFIX_QUERIES: 128}, PAGED, 3, None,
     0.25, None),
    ("paged-no-query", {PREEMPTIONS: 0, PREFIX_HITS: 0, PREFIX_QUERIES: 0}, PAGED, 0, None,
     None, "no prefix-cache query"),
    ("prefix-caching-off", {PREEMPTIONS: 1, PREFIX_HITS: 0, PREFIX_QUERIES: 0},
     PAGED | {"prefix_caching": False}, 1, None, None, "--no-enable-prefix-caching"),
    ("slab", {PREEMPTIONS: 0, PREFIX_HITS: 0, PREFIX_QUERIES: 0}, SLAB, 0, "0 by construction",
     None, "no prefix cache"),
    ("not-exported", {}, None, 0, "not exported", None, "not exported"),
    ("kv-cache-unknown", {PREEMPTIONS: 2, PREFIX_HITS: 1, PREFIX_QUERIES: 4}, None, 2, None,
     0.25, None),  # a server whose startup line was not found: its numbers as they are
]  # fmt: skip


@pytest.mark.parametrize("case", COUNTS, ids=[c[0] for c in COUNTS])
def test_preemptions_and_hit_rate_say_why_they_are_zero_or_missing(case):
    _, after, kv, preemptions, why, rate, rate_why = case
    row = server_counts({}, after, 2.0, kv)
    assert row["preemptions"] == preemptions and row["prefix_cache_hit_rate"] == rate
    for note, words in ((row["preemptions_note"], why), (row["prefix_cache_note"], rate_why)):
        assert note is None if words is None else words in note, (note, words)


LOGS = [
    # (id, the server's startup line, kv_cache_of's dict)
    ("paged", "moelora serve: KV cache of 40 blocks x 4 positions (160 tokens, 0.00 GiB: "
     "13.33 requests of --max-model-len 12 at once; at most --max-num-seqs 4 running), "
     "prefix caching off, sized by --num-gpu-blocks-override 41",
     {"paged": True, "blocks": 40, "block_size": 4, "prefix_caching": False}),
    ("slab", "moelora serve: KV cache of 64 rows x 172 positions (0.00 GiB), sized by "
     "--max-num-seqs x --max-model-len on transformers' forward (no CUDA GPU: ...)",
     {"paged": False, "rows": 64, "positions": 172}),
    ("no-line", "moelora serve: base and adapters [] on http://127.0.0.1:1/v1",
     {"paged": False, "rows": 7, "positions": None}),  # --max-num-seqs
]  # fmt: skip


@pytest.mark.parametrize("case", LOGS, ids=[c[0] for c in LOGS])
def test_the_kv_cache_is_read_from_the_servers_startup_line(case, tmp_path):
    _, line, expected = case
    (tmp_path / "server.log").write_text(f"INFO x\n{line}\nINFO y\n")
    args = SimpleNamespace(max_num_seqs=7)
    assert serve_load.kv_cache_of(tmp_path / "server.log", args) == expected


REQUESTS = 4
ARGV = ["--tiny", "--layers", "1", "--concurrency", "2", "--requests", str(REQUESTS),
        "--prompt-len", "uniform:4:12", "--output-len", "uniform:2:6", "--adapter-names", "6",
        "--adapters", "2", "--max-loras", "2", "--max-num-batched-tokens", "64",
        "--long-prompt", "160", "--long-streams", "2", "--long-stream-tokens", "48",
        "--request-timeout", "60", "--block-size", "8", "--no-enable-prefix-caching"]  # fmt: skip
LEVEL_FIELDS = {
    "run", "concurrency", "requests", "completed", "failed", "errors", "output_tokens",
    "seconds", "output_tok_s", "vs_lora_free", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
    "itl_p99_ms", "adapter_copies", "adapter_copies_per_s", "adapter_copy_seconds",
    "adapter_evictions", "preemptions", "preemptions_note", "prefix_cache_hit_rate",
    "prefix_cache_note", "adapter_names_drawn",
}  # fmt: skip
LONG_FIELDS = {
    "run", "requests", "completed", "failed", "errors", "streams", "stream_tokens",
    "long_prompt_tokens", "long_ttft_ms", "itl_before_p50_ms", "itl_before_p99_ms",
    "itl_during_p50_ms", "itl_during_p99_ms", "itl_p99_during_over_before", "gaps_before",
    "gaps_during", "streams_running_through",
}  # fmt: skip


def test_the_benchmark_runs_end_to_end_on_the_tiny_model(tmp_path):
    out = tmp_path / "serve_load.json"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "benchmarks.serve_load", *ARGV, "--work", str(tmp_path / "w"),
           "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["server"]["exit_code"] == 0
    assert doc["server"]["command"][:4] == ["moelora", "serve", str(tmp_path / "w" / "model"),
                                            "--load-format"]  # fmt: skip
    command = doc["server"]["command"]
    assert "--max-num-batched-tokens" in command and "--no-enable-prefix-caching" in command
    assert command[command.index("--block-size") + 1] == "8"
    # a CPU: transformers' forward (not paged), --max-num-seqs rows of the long prompt's
    # 160 tokens, its 4 outputs and 8 spare positions
    assert doc["server"]["kv_cache"] == {"paged": False, "rows": 64, "positions": 172}
    startup = doc["server"]["startup"]  # the server's own lines, the KV cache's among them
    assert any("KV cache of 64 rows x 172 positions" in line for line in startup), startup
    assert all(line.startswith("moelora serve: ") for line in startup)
    assert 0 < doc["server"]["ready_s"] < 240
    assert doc["warmup"]["requests"] == 7 and doc["warmup"]["failed"] == 0  # base + 6 names
    assert {"device", "commit", "torch"} <= set(doc["stamp"])
    runs = {r["run"]: r for r in doc["levels"]}
    assert [r["run"] for r in doc["levels"]] == ["lora-free", "adapters"]
    for r in doc["levels"]:
        assert set(r) == LEVEL_FIELDS, set(r) ^ LEVEL_FIELDS
        assert r["requests"] == REQUESTS == r["completed"] + r["failed"]
        assert r["failed"] == 0 and r["errors"] == {}, r["errors"]  # the tiny server fails none
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
        assert r["output_tokens"] >= 2 * REQUESTS and r["output_tok_s"] > 0
        assert r["preemptions"] == 0 and "0 by construction" in r["preemptions_note"]
        assert r["prefix_cache_hit_rate"] is None and "no prefix cache" in r["prefix_cache_note"]
    # the same arrivals: the same tokens; LoRA-free copies no adapter
    assert runs["lora-free"]["output_tokens"] == runs["adapters"]["output_tokens"]
    assert runs["lora-free"]["adapter_copies"] == 0 and runs["adapters"]["adapter_names_drawn"]
    # the warm-up leaves the last names (lora4, lora5) in the 2 slots; the seeded plan draws
    # lora0, the most popular: at least one copy into a slot, read from /metrics
    assert runs["adapters"]["adapter_copies"] >= 1 and runs["adapters"]["adapter_copies_per_s"] > 0
    assert runs["lora-free"]["vs_lora_free"] == 1.0
    assert [r["run"] for r in doc["long_prompt"]] == ["lora-free", "adapters"]
    for r in doc["long_prompt"]:
        assert set(r) == LONG_FIELDS, set(r) ^ LONG_FIELDS
        assert r["requests"] == 3 == r["completed"] + r["failed"] and r["failed"] == 0
        assert r["long_ttft_ms"] > 0 and r["gaps_before"] > 0 and r["gaps_during"] > 0
        assert 0 < r["itl_before_p50_ms"] <= r["itl_before_p99_ms"]
        assert 0 < r["itl_during_p50_ms"] <= r["itl_during_p99_ms"]
    table = done.stdout
    assert "| 2 | lora-free | 4 (0) |" in table and "| 2 | adapters | 4 (0) |" in table
    assert "| lora-free | 2 | 160 |" in table and "prefix hit rate: not applicable" in table
    assert "KV cache: 64 rows x 172 positions (not paged)" in table


class _Stub:
    """An AsyncOpenAI stand-in: completions.create answers `chunks` (words, usage) after
    `delay` seconds, or raises `error`."""

    def __init__(self, chunks=(), error=None, delay=0.0):
        self.completions, self.chunks, self.error, self.delay = self, chunks, error, delay

    async def create(self, **body):
        await asyncio.sleep(self.delay)
        if self.error:
            raise self.error

        async def stream():
            for text, usage in self.chunks:
                choice = SimpleNamespace(text=text)
                yield SimpleNamespace(choices=[choice] if text else [], usage=usage)

        return stream()


FAILURES = [
    # (id, client, what the error says): each way a request fails, counted with its reason
    ("raises", _Stub(error=ConnectionError("refused")), "ConnectionError: refused"),
    (
        "short-stream",
        _Stub([(" w1 w2", None), ("", SimpleNamespace(completion_tokens=2))]),
        "short stream: 2 of 3 tokens",
    ),
    ("no-token", _Stub([("", SimpleNamespace(completion_tokens=0))]), "0 of 3 tokens"),
    ("timeout", _Stub([(" w1", None)], delay=5.0), "TimeoutError"),  # past the 0.05 s limit
]


@pytest.mark.parametrize("case", FAILURES, ids=[c[0] for c in FAILURES])
def test_a_failed_request_is_counted_with_its_reason(case):
    _, client, words = case
    out = asyncio.run(serve_load.one(client, "base", [1, 2], 3, timeout=0.05))
    assert not out["ok"] and words in out["error"], out["error"]
    row = serve_load_report.outcome([out, {"ok": True, "error": None}])
    assert (row["requests"], row["completed"], row["failed"]) == (2, 1, 1)


def test_a_whole_stream_is_a_completed_request():
    usage = SimpleNamespace(completion_tokens=3)
    out = asyncio.run(serve_load.one(_Stub([(" w1", None), (" w2 w3", None), ("", usage)]),
                                     "base", [1], 3, timeout=5.0))  # fmt: skip
    assert out["ok"] and out["tokens"] == 3 and len(out["itl"]) == 2 and out["ttft"] > 0
