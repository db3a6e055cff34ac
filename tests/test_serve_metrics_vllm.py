"""/metrics as a router reads it: vLLM's families (names, types, labels, buckets as
vllm/v1/metrics/loggers.py declares them; the paged cache's values in test_serve_paged.py)
beside moelora's, parsed with prometheus_client's text parser from a real `moelora serve` on
127.0.0.1 (the `openai` client). With one adapter slot, a stream of adapter A holds it
while a request of adapter B waits: the gauges and vllm:lora_requests_info's running /
waiting labels follow A, then B, then nothing; slot residency names the adapter in the slot;
per-adapter series hold only loaded adapters (an unloaded one's counts move to __other__, a
name no adapter has never appears)."""

from __future__ import annotations

import random
import threading
import time

import httpx2 as httpx
import openai
import pytest
import serve_fixtures as sf
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.filterwarnings("ignore")

BASE = "base"
ROWS = 4
LONG = 1500  # tokens a held stream asks for: seconds of decoding, closed long before its end

# vLLM's bucket bounds (vllm/v1/metrics/loggers.py), typed out again: the server's own
# constants must equal these, not be read back from them
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
       20.0, 40.0, 80.0]  # fmt: skip
REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
# token counts: vLLM's 1-2-5 series up to --max-model-len (the model's 2 x LONG positions)
COUNTS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
ITERATION = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
N = [1, 2, 5, 10, 20]
ENGINE = {"model_name", "engine"}
CACHE_CONFIG = {"block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                "num_gpu_blocks", "num_gpu_blocks_override", "engine"}  # fmt: skip

# (family as the parser names it, type, its labels besides le, its bucket bounds or None)
VLLM_FAMILIES = [
    ("vllm:num_requests_running", "gauge", {"model_name", "engine"}, None),
    ("vllm:num_requests_waiting", "gauge", {"model_name", "engine"}, None),
    ("vllm:kv_cache_usage_perc", "gauge", {"model_name", "engine"}, None),
    ("vllm:num_preemptions", "counter", {"model_name", "engine"}, None),
    ("vllm:prefix_cache_queries", "counter", {"model_name", "engine"}, None),
    ("vllm:prefix_cache_hits", "counter", {"model_name", "engine"}, None),
    ("vllm:prompt_tokens", "counter", {"model_name", "engine"}, None),
    ("vllm:generation_tokens", "counter", {"model_name", "engine"}, None),
    ("vllm:request_success", "counter", {"model_name", "engine", "finished_reason"}, None),
    ("vllm:time_to_first_token_seconds", "histogram", {"model_name", "engine"}, TTFT),
    ("vllm:inter_token_latency_seconds", "histogram", {"model_name", "engine"}, ITL),
    ("vllm:time_per_output_token_seconds", "histogram", {"model_name", "engine"}, ITL),
    ("vllm:request_time_per_output_token_seconds", "histogram", {"model_name", "engine"}, ITL),
    ("vllm:e2e_request_latency_seconds", "histogram", {"model_name", "engine"}, REQUEST),
    ("vllm:request_queue_time_seconds", "histogram", {"model_name", "engine"}, REQUEST),
    ("vllm:request_inference_time_seconds", "histogram", ENGINE, REQUEST),
    ("vllm:request_prefill_time_seconds", "histogram", ENGINE, REQUEST),
    ("vllm:request_decode_time_seconds", "histogram", ENGINE, REQUEST),
    ("vllm:request_prompt_tokens", "histogram", ENGINE, COUNTS),
    ("vllm:request_generation_tokens", "histogram", ENGINE, COUNTS),
    ("vllm:request_params_max_tokens", "histogram", ENGINE, COUNTS),
    ("vllm:request_max_num_generation_tokens", "histogram", ENGINE, COUNTS),
    ("vllm:request_params_n", "histogram", ENGINE, N),
    ("vllm:iteration_tokens_total", "histogram", ENGINE, ITERATION),
    ("vllm:lora_requests_info", "gauge",
     {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}, None),
    ("vllm:cache_config_info", "gauge", CACHE_CONFIG, None),
]  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_seed):
    root = tmp_path_factory.mktemp("metrics")
    return sf.build(root, seed=model_seed, max_positions=2 * LONG)


@pytest.fixture(scope="module")
def server(served):
    """One adapter slot, ROWS rows: a second adapter waits while the first one runs."""
    argv = [str(served.root / "model"), "--served-model-name", BASE, "--max-loras", "1",
            "--max-num-seqs", str(ROWS), "--moe-backend", "reference", "--enable-runtime-lora",
            "--lora-modules", *[f"{n}={d}" for n, d in served.dirs.items()]]  # fmt: skip
    server = sf.start(argv, served.root / "server.log")
    yield server
    assert server.stop() == 0, server.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def families(server) -> dict:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, family: str, sample: str | None = None, absent=None, **labels) -> float:
    """The one sample of `family` (named `sample`, default the family's) with `labels`;
    `absent` when there is none and it is given (a series not created yet)."""
    found = [s.value for s in fams[family].samples
             if s.name == (sample or family) and labels.items() <= s.labels.items()]  # fmt: skip
    if not found and absent is not None:
        return absent
    assert len(found) == 1, (family, labels, fams[family].samples)
    return found[0]


def lora_info(fams: dict) -> tuple[str, str, float]:
    (sample,) = fams["vllm:lora_requests_info"].samples  # one series: the state now
    return sample.labels["running_lora_adapters"], sample.labels["waiting_lora_adapters"], (
        sample.value)  # fmt: skip


def wait_for(server, check, timeout_s: float = 60.0) -> dict:
    """Scrapes until `check(families)` holds; the last scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        fams = families(server)
        if check(fams):
            return fams
        assert time.monotonic() < deadline, lora_info(fams)
        time.sleep(0.02)


def test_vllm_families_have_vllms_names_types_labels_and_buckets(server, client):
    client.completions.create(model=BASE, prompt="w1 w2", max_tokens=2)
    fams = families(server)
    for name, kind, labels, buckets in VLLM_FAMILIES:
        assert fams[name].type == kind, name
        for s in fams[name].samples:
            assert set(s.labels) - {"le"} == labels, (name, s.labels)
            if "engine" in labels:
                assert s.labels["engine"] == "0"
            if "model_name" in labels:
                assert s.labels["model_name"] == BASE
        if buckets is not None:
            bounds = [float(s.labels["le"]) for s in fams[name].samples
                      if s.name == name + "_bucket"]  # fmt: skip
            assert bounds == [*buckets, float("inf")], name
    # a CPU: transformers' forward, one KV slab per row: nothing preempted, no prefix cache
    for name in ("vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
        assert value(fams, name, name + "_total") == 0, name
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}  # vLLM's, from 0
    assert value(fams, "vllm:request_success", "vllm:request_success_total",
                 finished_reason="length") >= 1  # fmt: skip


def test_per_request_histograms_count_each_row_and_prompt(served, server, client, seed):
    """Two prompts of lengths p, q with n = 2 and max_tokens m (no end token: every row
    runs m): 4 rows of their prompt's tokens, m generated, max_tokens m; 2 prompts of n 2,
    m at most; the steps forwarded every prompt token once and m - 1 decodes per row; each
    row counted once in the phase histograms, with time in both phases."""
    rng = random.Random(seed)
    lengths, m = [rng.randrange(2, 9), rng.randrange(2, 9)], rng.randrange(2, 6)
    prompts = [[rng.randrange(1, 96) for _ in range(n)] for n in lengths]
    idle = lambda f: value(f, "vllm:num_requests_running", model_name=BASE) == 0  # noqa: E731
    before = wait_for(server, idle)
    out = client.completions.create(model=BASE, prompt=prompts, max_tokens=m, n=2)
    assert [c.finish_reason for c in out.choices] == ["length"] * 4
    after = wait_for(server, idle)
    fams = {f: {s.name: s.value for s in after[f].samples} for f in after}
    was = {f: {s.name: s.value for s in before[f].samples} for f in before}

    def grew(family: str, part: str) -> float:
        name = f"{family}_{part}"
        return fams[family][name] - was[family].get(name, 0)

    rows, tokens = [(n, m) for n in lengths for _ in range(2)], sum(lengths)
    for family, count, total in (
        ("vllm:request_prompt_tokens", 4, 2 * tokens),
        ("vllm:request_generation_tokens", 4, 4 * m),
        ("vllm:request_params_max_tokens", 4, 4 * m),
        ("vllm:request_params_n", 2, 4),
        ("vllm:request_max_num_generation_tokens", 2, 2 * m),
    ):
        assert (grew(family, "count"), grew(family, "sum")) == (count, total), family
    # vLLM's count: each sampled token, and each prompt once, at its first token's step
    assert grew("vllm:iteration_tokens_total", "sum") == sum(n + m for n, m in rows)
    assert grew("vllm:iteration_tokens_total", "count") >= m  # at least one step per token
    times = {f: grew(f"vllm:request_{f}_time_seconds", "sum")
             for f in ("prefill", "decode", "inference")}  # fmt: skip
    for f in times:
        assert grew(f"vllm:request_{f}_time_seconds", "count") == 4, f
    assert times["prefill"] > 0 and times["decode"] > 0  # each row spent time in both
    (info,) = after["vllm:cache_config_info"].samples
    assert info.value == 1 and info.labels["enable_prefix_caching"] == "False"  # a slab cache
    assert int(info.labels["num_gpu_blocks"]) == ROWS  # one slab of max_model_len per row
    assert int(info.labels["block_size"]) == 2 * LONG


def test_running_and_waiting_adapters_follow_the_requests(served, server, client, seed):
    rng = random.Random(seed)
    first, second = rng.sample(sorted(served.dirs), 2)
    wait_for(server, lambda f: lora_info(f)[:2] == ("", ""))
    before = families(server)
    stream_a = client.completions.create(model=first, prompt="w1 w2", max_tokens=LONG,
                                         stream=True)  # fmt: skip
    next(iter(stream_a))  # A runs: its response starts once its row does
    streams = {}
    waiter = threading.Thread(target=lambda: streams.setdefault("b", client.completions.create(
        model=second, prompt="w3", max_tokens=LONG, stream=True)))  # fmt: skip
    waiter.start()  # B waits: the one slot is A's while A runs
    fams = wait_for(server, lambda f: lora_info(f)[:2] == (first, second))
    assert value(fams, "vllm:num_requests_running", model_name=BASE) == 1
    assert value(fams, "vllm:num_requests_waiting", model_name=BASE) == 1
    assert value(fams, "vllm:kv_cache_usage_perc", model_name=BASE) == 1 / ROWS
    assert value(fams, "moelora_lora_slot_info", slot="0") == 1
    assert {s.labels["adapter_name"] for s in fams["moelora_lora_slot_info"].samples} == {first}
    assert value(fams, "moelora_lora_adapter_loaded", adapter_name=first) == 1
    assert {s.labels["level"] for s in fams["moelora_lora_adapter_loaded"].samples
            if s.labels["adapter_name"] == first} == {"gpu"}  # fmt: skip
    stream_a.close()  # A's client leaves: its row ends, B takes the slot
    waiter.join(120)
    next(iter(streams["b"]))
    fams = wait_for(server, lambda f: lora_info(f)[:2] == (second, ""))
    assert {s.labels["adapter_name"] for s in fams["moelora_lora_slot_info"].samples} == {second}
    assert {s.labels["level"] for s in fams["moelora_lora_adapter_loaded"].samples
            if s.labels["adapter_name"] == first} == {"cpu"}  # fmt: skip
    streams["b"].close()
    after = wait_for(server, lambda f: lora_info(f)[:2] == ("", "")
                     and value(f, "vllm:num_requests_running", model_name=BASE) == 0)  # fmt: skip
    assert lora_info(after)[2] > lora_info(before)[2]  # stamped with the time, as vLLM's
    assert abs(lora_info(after)[2] - time.time()) < 60

    def grew(name: str, sample: str, **labels) -> float:
        return value(after, name, sample, **labels) - value(before, name, sample, 0, **labels)

    assert grew("vllm:request_success", "vllm:request_success_total", finished_reason="abort") == 2
    assert grew("vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_count") == 2
    assert grew("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 2
    assert grew("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 3
    for adapter, prompt_tokens in ((first, 2), (second, 1)):
        assert grew("moelora_lora_requests", "moelora_lora_requests_total",
                    adapter_name=adapter) == 1  # fmt: skip
        assert grew("moelora_lora_prompt_tokens", "moelora_lora_prompt_tokens_total",
                    adapter_name=adapter) == prompt_tokens  # fmt: skip
        assert grew("moelora_lora_generation_tokens", "moelora_lora_generation_tokens_total",
                    adapter_name=adapter) >= 1  # fmt: skip
    total = grew("vllm:generation_tokens", "vllm:generation_tokens_total")
    assert total == grew("moelora_lora_generation_tokens", "moelora_lora_generation_tokens_total",
                         adapter_name=first) + grew("moelora_lora_generation_tokens",
                         "moelora_lora_generation_tokens_total", adapter_name=second)  # fmt: skip


def test_per_adapter_labels_are_only_loaded_adapters(served, server, client, seed):
    rng = random.Random(seed)
    strangers = [f"nope-{rng.randrange(10**9)}" for _ in range(5)]
    for name in strangers:
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=name, prompt="w1", max_tokens=1)
    # a runtime-loaded name with the characters the format escapes
    odd = f'q"uo\\te\nnl-{rng.randrange(10**6)}'
    source = rng.choice(sorted(served.dirs))
    load = httpx.post(server.url + "/v1/load_lora_adapter",
                      json={"lora_name": odd, "lora_path": str(served.dirs[source])})  # fmt: skip
    assert load.status_code == 200, load.text
    client.completions.create(model=odd, prompt="w5 w6 w7", max_tokens=2)
    fams = families(server)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert not any(name in text for name in strangers)
    assert (
        value(fams, "moelora_lora_requests", "moelora_lora_requests_total", adapter_name=odd) == 1
    )
    assert value(fams, "moelora_lora_adapter_load_seconds",
                 "moelora_lora_adapter_load_seconds_count", source="runtime") >= 1  # fmt: skip
    total = sum(s.value for s in fams["moelora_lora_requests"].samples)
    unload = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": odd})
    assert unload.status_code == 200, unload.text
    after = families(server)
    labels = {s.labels["adapter_name"] for f in ("moelora_lora_requests",
              "moelora_lora_adapter_loaded") for s in after[f].samples}  # fmt: skip
    assert odd not in labels and labels - {"__other__"} <= set(served.dirs)
    assert sum(s.value for s in after["moelora_lora_requests"].samples) == total
    assert value(after, "moelora_lora_requests", "moelora_lora_requests_total",
                 adapter_name="__other__") >= 1  # fmt: skip
