"""`moelora serve` as a user meets it: a real server process on 127.0.0.1 with a tiny random
model directory and PEFT-written adapters, talked to with the official `openai` client.
Every greedy answer equals HF + PEFT generating that prompt alone with that adapter (fp32)."""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import serve_fixtures as sf

pytestmark = pytest.mark.filterwarnings("ignore")

KEY = "sk-test"
BASE = "base"
ADAPTERS = ["fused-r8", "fused-r4-attn", "modules-r4", "fused-r2"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_seed):
    return sf.build(tmp_path_factory.mktemp("served"), seed=model_seed)


@pytest.fixture(scope="module")
def server(served):
    """max-loras 2 < 4 adapters: requests of a third adapter wait for a slot."""
    argv = [str(served.root / "model"), "--served-model-name", BASE, "--api-key", KEY,
            "--max-loras", "2", "--moe-backend", "reference", "--enable-runtime-lora",
            "--lora-modules", *[f"{n}={served.dirs[n]}" for n in ADAPTERS]]  # fmt: skip
    server = sf.start(argv, served.root / "server.log")
    yield server
    assert server.stop() == 0, server.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def words(count: int, rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(1, 96)}" for _ in range(count))


def truth_text(served, adapter: str | None, prompt_ids: list[int], n: int) -> str:
    return sf.truth_text(served, adapter, prompt_ids, n)


def prompt_ids(served, text: str) -> list[int]:
    return served.tokenizer(text)["input_ids"]


def test_models_lists_the_base_and_every_adapter(client):
    assert [m.id for m in client.models.list().data] == [BASE, *sorted(ADAPTERS)]


CASES = [
    # (id, adapter, prompt words, max_tokens): which edge it covers
    ("base-one-word", BASE, 1, 4),  # a one-token prompt, no adapter
    ("fused-r8", "fused-r8", 5, 4),  # experts-only adapter
    ("attn-lora", "fused-r4-attn", 7, 3),  # experts + attention LoRA (PEFT modules)
    ("modules-rewritten", "modules-r4", 3, 5),  # target_modules PEFT rewrote
    ("rank-pattern", "fused-r2", 9, 2),  # per-module ranks
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_greedy_completion_equals_hf_peft_alone(case, served, client, seed):
    _, adapter, count, n = case
    prompt = words(count, random.Random(seed))
    out = client.completions.create(model=adapter, prompt=prompt, max_tokens=n, temperature=0)
    ref = truth_text(served, adapter, prompt_ids(served, prompt), n)
    assert out.choices[0].text == ref, (prompt, out.choices[0].text, ref)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (count, n)


def test_chat_completion_uses_the_chat_template(served, client, seed):
    messages = [{"role": "user", "content": words(4, random.Random(seed))}]
    out = client.chat.completions.create(model="fused-r8", messages=messages, max_tokens=3,
                                         temperature=0)  # fmt: skip
    rendered = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=False)  # fmt: skip
    ref = truth_text(served, "fused-r8", prompt_ids(served, rendered), 3)
    assert out.choices[0].message.content == ref and out.choices[0].message.role == "assistant"


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_chunks_concatenate_to_the_whole_text(chat, served, client, seed):
    # a prompt whose 5 greedy tokens show at least 2 words (the random model's <pad>, token 0,
    # decodes to nothing, and a run of them to one empty chunk), found with HF + PEFT
    rng = random.Random(seed)
    for _ in range(50):
        prompt = words(6, rng)
        msgs = [{"role": "user", "content": prompt}]
        text = served.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                    tokenize=False) if chat else prompt  # fmt: skip
        if len(truth_text(served, "fused-r4-attn", prompt_ids(served, text), 5).split()) >= 2:
            break
    else:
        raise AssertionError("no prompt of 50 shows 2 words in 5 greedy tokens: see the model")
    kw = dict(model="fused-r4-attn", max_tokens=5, temperature=0)
    if chat:
        whole = client.chat.completions.create(messages=msgs, **kw).choices[0].message.content
        chunks = list(client.chat.completions.create(messages=msgs, stream=True, **kw))
        parts = [c.choices[0].delta.content or "" for c in chunks]
    else:
        whole = client.completions.create(prompt=prompt, **kw).choices[0].text
        chunks = list(client.completions.create(prompt=prompt, stream=True, **kw))
        parts = [c.choices[0].text for c in chunks]
    assert "".join(parts) == whole and len(parts) >= 2
    assert chunks[-1].choices[0].finish_reason == "length"


def metric(server, name: str) -> float:
    import httpx2 as httpx

    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_stop_string_ends_the_text_before_it(served, server, client, seed):
    stopped = 'moelora_requests_total{finish_reason="stop"}'
    before = metric(server, stopped)
    prompt = words(4, random.Random(seed))
    full = client.completions.create(model="fused-r8", prompt=prompt, max_tokens=5, temperature=0)
    cut = full.choices[0].text.split(" ")[2]  # the third word: the text stops before it
    out = client.completions.create(model="fused-r8", prompt=prompt, max_tokens=5, temperature=0,
                                    stop=[" " + cut])  # fmt: skip
    assert out.choices[0].text == full.choices[0].text.split(" " + cut)[0]
    assert out.choices[0].finish_reason == "stop"
    for _ in range(400):  # bounded (20 s): the engine ends the row at its next step
        if metric(server, stopped) == before + 1:
            break
        time.sleep(0.05)
    assert metric(server, stopped) == before + 1  # counted as a stop, not a cancellation


def test_16_concurrent_clients_over_4_adapters_and_base(served, client, seed):
    """More adapters (4) than slots (2): every request is held until it fits, none refused."""
    rng = random.Random(seed)
    jobs = [([*ADAPTERS, BASE][i % 5], words(rng.randrange(1, 8), rng)) for i in range(16)]

    def ask(job):
        adapter, prompt = job
        return client.completions.create(model=adapter, prompt=prompt, max_tokens=2, temperature=0)

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, jobs))
    for (adapter, prompt), out in zip(jobs, answers):
        ref = truth_text(served, adapter, prompt_ids(served, prompt), 2)
        assert out.choices[0].text == ref, (adapter, prompt)


def test_seeded_sampling_repeats(client, seed):
    kw = dict(model="modules-r4", prompt="w3 w4", max_tokens=6, temperature=1.0, seed=seed)
    assert client.completions.create(**kw).choices[0].text == (
        client.completions.create(**kw).choices[0].text
    )


ERRORS = [
    # (id, request kwargs, error class, words in the message)
    ("unknown-adapter", dict(model="nope"), openai.NotFoundError, ["nope", "fused-r8", BASE]),
    ("bad-temperature", dict(temperature=-1), openai.BadRequestError, ["temperature", "-1"]),
    ("bad-max-tokens", dict(max_tokens=0), openai.BadRequestError, ["max_tokens"]),
    ("prompt-too-long", dict(prompt=" ".join(["w3"] * 130)), openai.BadRequestError, ["128"]),
    ("output-too-long", dict(max_tokens=200), openai.BadRequestError, ["128"]),
    ("token-id-out-of-range", dict(prompt=[5, 999]), openai.BadRequestError, ["999", "96"]),
    ("unsupported-field", dict(best_of=2), openai.BadRequestError, ["best_of", "not supported"]),
]


@pytest.mark.parametrize("case", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_request_gets_an_openai_error_naming_it(case, client):
    _, kwargs, error, words_ = case
    request = dict(model="fused-r8", prompt="w1 w2", max_tokens=2) | kwargs
    with pytest.raises(error) as caught:
        client.completions.create(**request)
    message = caught.value.body["message"]
    assert all(w in message for w in words_), message


def test_malformed_json_is_a_400(server):
    import httpx2 as httpx

    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    got = httpx.post(server.url + "/v1/completions", content=b"{not json", headers=headers)
    assert got.status_code == 400 and "invalid JSON" in got.json()["error"]["message"]


@pytest.mark.parametrize("key", [None, "sk-wrong"], ids=["missing", "wrong"])
def test_api_key_is_required(server, key):
    import httpx2 as httpx

    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    got = httpx.get(server.url + "/v1/models", headers=headers)
    assert got.status_code == 401 and "API key" in got.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200  # open: probes carry no key


def test_runtime_loads_while_others_generate(served, server, client, tmp_path, seed):
    """Bad load -> 400 and the old version keeps serving; good load serves; unload -> 404.
    Threads generate all along, every answer checked."""
    import httpx2 as httpx

    rng = random.Random(seed)
    prompts = [words(rng.randrange(2, 6), rng) for _ in range(4)]
    want = {(a, p): truth_text(served, a, prompt_ids(served, p), 2)
            for a in ("fused-r2", BASE) for p in prompts}  # fmt: skip
    stop, wrong = threading.Event(), []

    def generate():
        for i in range(200):  # bounded: ends by itself
            if stop.is_set():
                return
            adapter, prompt = ("fused-r2", BASE)[i % 2], prompts[i % 4]
            out = client.completions.create(
                model=adapter, prompt=prompt, max_tokens=2, temperature=0
            )
            if out.choices[0].text != want[adapter, prompt]:
                wrong.append((adapter, prompt, out.choices[0].text))

    bad = tmp_path / "bad"
    shutil.copytree(served.dirs["fused-r2"], bad)
    (bad / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    headers = {"Authorization": f"Bearer {KEY}"}

    def post(route, body):
        return httpx.post(f"{server.url}/v1/{route}", json=body, headers=headers, timeout=120)

    threads = [threading.Thread(target=generate) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        got = post("load_lora_adapter", {"lora_name": "fused-r2", "lora_path": str(bad)})
        assert got.status_code == 400 and "fused-r2" in got.json()["error"]["message"]
        source = served.dirs["fused-r4-attn"]
        assert (
            post("load_lora_adapter", {"lora_name": "extra", "lora_path": str(source)}).status_code
            == 200
        )
        out = client.completions.create(
            model="extra", prompt=prompts[0], max_tokens=2, temperature=0
        )
        assert out.choices[0].text == truth_text(
            served, "fused-r4-attn", prompt_ids(served, prompts[0]), 2
        )
        assert post("unload_lora_adapter", {"lora_name": "extra"}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="extra", prompt=prompts[0], max_tokens=2)
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    assert not wrong, wrong
    assert [m.id for m in client.models.list().data] == [BASE, *sorted(ADAPTERS)]


def test_metrics_count_requests_tokens_and_latencies(served, server, client, seed):
    """After one request of each adapter and a runtime load and unload (the module's other
    tests may have run on another worker's server: this one's traffic is its own)."""
    import httpx2 as httpx

    def metrics() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics").text
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                         if not line.startswith("#"))}  # fmt: skip

    def post(route, body):
        return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip

    before = metrics()
    source = str(served.dirs[ADAPTERS[0]])
    assert (
        post("load_lora_adapter", {"lora_name": "counted", "lora_path": source}).status_code == 200
    )
    assert post("unload_lora_adapter", {"lora_name": "counted"}).status_code == 200
    rng = random.Random(seed)
    for name in ADAPTERS:  # 4 adapters through 2 slots, one after another
        done = client.completions.create(model=name, prompt=words(3, rng), max_tokens=3,
                                         temperature=0)  # fmt: skip
        assert done.choices[0].finish_reason == "length"
    values = metrics()
    grew = {k: values[k] - before.get(k, 0.0) for k in values}
    assert grew["moelora_generation_tokens_total"] >= 12
    assert grew['moelora_requests_total{finish_reason="length"}'] >= 4
    assert grew["moelora_time_to_first_token_seconds_count"] >= 4
    assert grew["moelora_inter_token_latency_seconds_count"] >= 8
    assert grew["moelora_adapter_loads_total"] == 1 and grew["moelora_adapter_unloads_total"] == 1
    # 4 adapters through 2 slots: at least two were not resident, copied in, others evicted
    assert grew["moelora_adapter_slot_loads_total"] >= 2
    assert grew["moelora_adapter_evictions_total"] >= 1
    assert "moelora_requests_queued" in values and "moelora_rows_running" in values


def test_run_batch_lines_match_the_servers_answers(served, client, tmp_path, seed):
    rng = random.Random(seed)
    good = [
        (f"req-{i}", a, words(rng.randrange(1, 6), rng)) for i, a in enumerate([*ADAPTERS, BASE])
    ]
    lines = [json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                         "body": {"model": a, "prompt": p, "max_tokens": 3, "temperature": 0}})
             for cid, a, p in good]  # fmt: skip
    lines += [
        json.dumps({"custom_id": "unknown", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "nope", "prompt": "w1", "max_tokens": 2}}),
        json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}),
        '{"custom_id": "broken", ',
    ]  # fmt: skip
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    argv = ["run-batch", str(served.root / "model"), "-i", str(tmp_path / "in.jsonl"),
            "-o", str(tmp_path / "out.jsonl"), "--served-model-name", BASE, "--max-loras", "2",
            "--moe-backend", "reference",
            "--lora-modules", *[f"{n}={served.dirs[n]}" for n in ADAPTERS]]  # fmt: skip
    assert sf.run_child(argv, tmp_path / "batch.log") == 0, (tmp_path / "batch.log").read_text()
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    # completion order: records are matched by custom_id (each at most once), as OpenAI's are
    by_id = {r["custom_id"]: r for r in records}
    assert len(by_id) == len(records) == len(good) + 3
    assert set(by_id) == {g[0] for g in good} | {"unknown", "bad-url", None}
    for cid, adapter, prompt in good:
        record = by_id[cid]
        server_text = (
            client.completions.create(model=adapter, prompt=prompt, max_tokens=3, temperature=0)
            .choices[0]
            .text
        )
        assert record["error"] is None
        assert record["response"]["body"]["choices"][0]["text"] == server_text, cid
    errors = {cid: by_id[cid]["error"] for cid in ("unknown", "bad-url", None)}
    assert errors["unknown"]["code"] == 404 and "fused-r8" in errors["unknown"]["message"]
    assert errors["bad-url"]["code"] == 400 and "/v1/embeddings" in errors["bad-url"]["message"]
    assert errors[None]["code"] == 400 and "invalid JSON" in errors[None]["message"]
