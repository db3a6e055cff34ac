"""`moelora serve` on the decode runner's paged KV cache (on a CPU: its kernels through
Triton's interpreter), from real server processes on 127.0.0.1 and the official `openai`
client. --block-size 4 and --num-gpu-blocks-override one block above one --max-model-len
request: concurrent requests preempt each other, and each still answers what it answers
alone on the same server (and what HF + PEFT give it alone); /metrics shows vLLM's
num_preemptions, prefix_cache_queries / _hits and kv_cache_usage_perc (0 again once nothing
runs); a repeated prompt reads its leading full blocks from the cache, and with
--no-enable-prefix-caching reads none. The flags' refusals name the flag, the value and the
fix; with the runner off the paged flags are said not to apply."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx2 as httpx
import openai
import pytest
import serve_fixtures as sf
from prometheus_client.parser import text_string_to_metric_families

from moelora.cli import main
from moelora.hf import toy

pytestmark = pytest.mark.filterwarnings("ignore")

BASE = "base"
ADAPTER = "fused-r8"
BLOCK = 4
MAX_LEN = 12  # 3 blocks of 4
BLOCKS = 5  # the null block, one --max-model-len request's 3, and one more
PROMPT, NEW = 5, 6  # 11 positions: a request grows to 3 blocks, 2 held at its start
PREEMPTIONS = "vllm:num_preemptions"
QUERIES, HITS = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"
USAGE = "vllm:kv_cache_usage_perc"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The weights are fixed (seed 3), the prompts drawn from each test's seed: a failure
    reproduces with MOELORA_SEED alone."""
    return sf.build(tmp_path_factory.mktemp("paged"), seed=3, max_positions=64)


@pytest.fixture(scope="module")
def servers(served):
    """Two paged servers, started together (their startups overlap): prefix caching on (the
    default) and off."""
    argv = [str(served.root / "model"), "--served-model-name", BASE, "--moe-backend",
            "reference", "--decode-runner", "on", "--block-size", str(BLOCK),
            "--max-model-len", str(MAX_LEN), "--num-gpu-blocks-override", str(BLOCKS),
            "--max-num-seqs", "4",
            "--lora-modules", f"{ADAPTER}={served.dirs[ADAPTER]}"]  # fmt: skip
    runs = {"cached": argv, "uncached": [*argv, "--no-enable-prefix-caching"]}
    started: dict = {}

    def start(name: str) -> None:
        try:
            started[name] = sf.start(runs[name], served.root / f"{name}.log")
        except Exception as err:  # raised again below, on the test's thread
            started[name] = err

    threads = [threading.Thread(target=start, args=(name,)) for name in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    try:
        for value in started.values():
            if isinstance(value, Exception):
                raise value
        yield started
    finally:
        for server in started.values():
            if not isinstance(server, Exception):
                assert server.stop() == 0, server.log.read_text()


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def scrape(server) -> dict[str, float]:
    """Each vLLM family's one sample (a counter's `_total`), by family name."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("vllm:") and fam.type in ("gauge", "counter"):
            samples = [s for s in fam.samples if "model_name" in s.labels]
            if len(samples) == 1:
                assert samples[0].labels == {"model_name": BASE, "engine": "0"}, samples
                out[fam.name] = samples[0].value
    return out


def idle(server, timeout_s: float = 60.0) -> dict[str, float]:
    """Scrapes until nothing runs (the scheduler's report after the last step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = scrape(server)
        if got["vllm:num_requests_running"] == 0 and got[USAGE] == 0:
            return got
        assert time.monotonic() < deadline, got
        time.sleep(0.05)


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 96) for _ in range(n)]  # w0 is the tokenizer's <pad>


def complete(client, model: str, ids: list[int], n: int) -> str:
    prompt = " ".join(f"w{i}" for i in ids)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == n
    return out.choices[0].text


def test_preempted_requests_answer_what_they_answer_alone(served, servers, seed):
    """3 requests at once over 4 blocks, each growing to 3: the newest are preempted and
    recomputed, and every answer equals the same request sent alone, and HF + PEFT's."""
    server, rng = servers["cached"], random.Random(seed)
    client = client_of(server)
    requests = [(model, words(rng, PROMPT)) for model in (BASE, ADAPTER, BASE)]
    before = idle(server)
    together: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i, m, p: together.setdefault(i, complete(
        client, m, p, NEW)), args=(i, m, p)) for i, (m, p) in enumerate(requests)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    after = idle(server)  # every block back: usage 0
    assert sorted(together) == [0, 1, 2], together
    assert after[PREEMPTIONS] > before[PREEMPTIONS]
    assert after[QUERIES] >= before[QUERIES] + len(requests) * PROMPT
    for i, (model, prompt) in enumerate(requests):
        alone = complete(client, model, prompt, NEW)
        assert together[i] == alone, (i, model)
        assert alone == sf.truth_text(served, model, prompt, NEW), (i, model)
    assert idle(server)[USAGE] == 0


REPEATS = [
    # (id, server, hits): the second of two equal prompts of 9 tokens reads its 2 full
    # blocks (the last token, the 9th, is always computed) only with prefix caching on
    ("prefix-caching", "cached", 2 * BLOCK),
    ("no-prefix-caching", "uncached", 0),
]


@pytest.mark.parametrize("case", REPEATS, ids=[c[0] for c in REPEATS])
def test_a_repeated_prompt_reads_its_cached_blocks(case, servers, seed):
    _, name, hits = case
    server, prompt = servers[name], words(random.Random(seed + 1), 2 * BLOCK + 1)
    client = client_of(server)
    first = complete(client, BASE, prompt, 2)
    before = idle(server)
    assert complete(client, BASE, prompt, 2) == first
    after = idle(server)
    assert after[HITS] - before[HITS] == hits
    # vLLM counts a query only where a prefix cache is looked up
    assert after[QUERIES] - before[QUERIES] == (len(prompt) if hits else 0)
    assert after[PREEMPTIONS] == before[PREEMPTIONS]  # one request: never out of blocks


@pytest.fixture(scope="module")
def unknown_model(tmp_path_factory):
    """An OLMoE model with clip_qkv: moelora serves it, the decode runner does not know it."""
    root = tmp_path_factory.mktemp("unknown") / "model"
    base = toy.build_model("olmoe", seed=5, clip_qkv=8.0)
    base.save_pretrained(root)
    sf.word_tokenizer(base.config.vocab_size).save_pretrained(root)
    return root


REFUSALS = [
    # (id, model ("unknown": one the runner does not know), flags, words in the error)
    ("override-below-one-request", "served",
     ["--decode-runner", "on", "--block-size", "4", "--max-model-len", "12",
      "--num-gpu-blocks-override", "3"],
     ["--num-gpu-blocks-override", "= 3", ">= 4", "--max-model-len 12",
      "pass --num-gpu-blocks-override 4 or more"]),
    ("override-default-block-and-length", "served",  # 64 positions / 16 = 4 blocks + null
     ["--decode-runner", "on", "--num-gpu-blocks-override", "4"],
     ["--num-gpu-blocks-override", "= 4", ">= 5", "--block-size 16"]),
    ("override-with-the-runner-off", "served",
     ["--decode-runner", "off", "--num-gpu-blocks-override", "64"],
     ["--num-gpu-blocks-override", "= 64", "--decode-runner off",
      "leave --num-gpu-blocks-override out"]),
    ("override-where-auto-keeps-the-slab", "served",  # a CPU: auto runs transformers' forward
     ["--num-gpu-blocks-override", "64"],
     ["--num-gpu-blocks-override", "= 64", "no CUDA GPU", "pass --decode-runner on"]),
    ("runner-on-for-a-model-it-does-not-know", "unknown", ["--decode-runner", "on"],
     ["--decode-runner", "'on'", "clip_qkv 8.0", "pass --decode-runner auto (or off)"]),
    ("runner-not-a-choice", "served", ["--decode-runner", "yes"],
     ["--decode-runner", "'yes'", "auto", "off"]),
    ("block-size-zero", "served", ["--block-size", "0"], ["--block-size", ">= 1"]),
    ("long-prefill-threshold-negative", "served", ["--long-prefill-token-threshold", "-1"],
     ["--long-prefill-token-threshold", "'-1'", ">= 0"]),
]  # fmt: skip


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_refusals_name_the_flag_the_value_and_the_fix(case, served, unknown_model, capsys):
    _, which, flags, expected = case
    model = unknown_model if which == "unknown" else served.root / "model"
    argv = ["serve", str(model), "--moe-backend", "reference", "--port", str(sf.free_port())]
    try:
        code = main([*argv, *flags])
    except SystemExit as usage:  # argparse's refusal
        code = usage.code
    err = capsys.readouterr().err
    assert code == 2 and all(w in err for w in expected), err
    assert "Traceback" not in err


def test_with_the_runner_off_the_paged_flags_are_said_not_to_apply(served, tmp_path, capsys):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"model": BASE, "prompt": "w1 w2", "max_tokens": 1}
    source.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                  "body": body}) + "\n")  # fmt: skip
    code = main(["run-batch", str(served.root / "model"), "-i", str(source), "-o", str(out),
                 "--served-model-name", BASE, "--moe-backend", "reference", "--decode-runner",
                 "off", "--block-size", "8", "--no-enable-prefix-caching"])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0 and json.loads(out.read_text())["error"] is None
    (line,) = [x for x in printed.splitlines() if "KV cache" in x]
    assert "rows x 64 positions" in line and "transformers' forward (--decode-runner off)" in line
    assert "--block-size and --enable-prefix-caching apply to the decode runner's" in line


def test_long_prefill_token_threshold_reaches_the_engine_and_rows_stay_exact(
    served, tmp_path, monkeypatch, capsys
):
    """run-batch on the runner with --long-prefill-token-threshold 3: the engine gets it
    (test_paged_engine checks what it does to the steps), and the completion of a 12-word
    prompt equals the one without the flag."""
    from moelora.engine import engine as engine_module

    seen, real = [], engine_module.Engine.__init__

    def record(self, *a, **kw):
        seen.append(kw.get("long_prefill_token_threshold"))
        real(self, *a, **kw)

    monkeypatch.setattr(engine_module.Engine, "__init__", record)
    body = {"model": ADAPTER, "prompt": " ".join(f"w{i}" for i in range(1, 13)),
            "max_tokens": 4, "temperature": 0}  # fmt: skip
    texts = []
    for flags in ([], ["--long-prefill-token-threshold", "3"]):
        source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        source.write_text(json.dumps({"custom_id": "a", "method": "POST",
                                      "url": "/v1/completions", "body": body}) + "\n")  # fmt: skip
        code = main(["run-batch", str(served.root / "model"), "-i", str(source), "-o", str(out),
                     "--served-model-name", BASE, "--moe-backend", "reference",
                     "--decode-runner", "on", "--block-size", str(BLOCK), "--max-model-len",
                     "32", "--lora-modules", f"{ADAPTER}={served.dirs[ADAPTER]}",
                     *flags])  # fmt: skip
        line = json.loads(out.read_text())
        assert code == 0 and line["error"] is None, line
        texts.append(line["response"]["body"]["choices"][0]["text"])
    capsys.readouterr()
    assert seen[-2:] == [0, 3]
    assert texts[0] == texts[1] and texts[0]


def test_serve_takes_vllm_serves_step_budget_and_run_batch_the_engines(
    served, tmp_path, monkeypatch, capsys
):
    """--max-num-batched-tokens not given: `moelora serve` gives its engine 8192 (`vllm
    serve`'s default on a large GPU), run-batch leaves the engine's 16384; given, it is used.
    (The engine is stopped at its construction: what it was given is the question.)"""
    from moelora.engine import engine as engine_module
    from moelora.errors import ConfigError

    seen = []

    def record(self, *a, **kw):
        seen.append(kw.get("max_num_batched_tokens"))
        raise ConfigError("engine", "stopped", "a test that only reads the engine's arguments")

    monkeypatch.setattr(engine_module.Engine, "__init__", record)
    model = str(served.root / "model")
    common = ["--moe-backend", "reference", "--decode-runner", "on", "--max-model-len", "32"]
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": model, "prompt": "w1"}}) + "\n")  # fmt: skip
    runs = [["serve", model, "--port", str(sf.free_port()), *common],
            ["run-batch", model, "-i", str(source), "-o", str(tmp_path / "out.jsonl"), *common],
            ["serve", model, "--port", str(sf.free_port()), *common,
             "--max-num-batched-tokens", "100"]]  # fmt: skip
    codes = [main(argv) for argv in runs]
    err = capsys.readouterr().err
    assert codes == [2, 2, 2] and err.count("a test that only reads") == 3, err
    assert seen == [8192, None, 100]
