"""`moelora serve` under the inputs and faults an operator tries (issue 34): a real server
process on 127.0.0.1, the official `openai` client and raw HTTP. Every bad body is a 4xx
OpenAI error object naming the field (never a 5xx, never a hang, never the end of other
requests); the OpenAI / vLLM fields clients send are served, each answer equal to HF + PEFT
generating it alone; runtime loads are confined and say nothing of the filesystem; large
and slow bodies are bounded; a stream never tears; metrics account for every request; a
fuzz of 2000 bodies leaves the server answering correctly; Ctrl-C cuts the rows left with
OpenAI errors and exits 0. One server, stopped by the last test."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest
import serve_fixtures as sf
import torch

pytestmark = pytest.mark.filterwarnings("ignore")

KEY = "sk-edges"
BASE = "base"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = (
    "{% for m in messages %}w3 {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w8{% endif %}"
)


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_seed):
    # 4096 positions: rows that run long enough to be caught running
    return sf.build(tmp_path_factory.mktemp("edges"), seed=model_seed,
                    max_positions=4096)  # fmt: skip


@pytest.fixture(scope="module")
def server(served):
    (served.root / "template.jinja").write_text(TEMPLATE)
    json_module = json.dumps({"name": "fused-r2", "path": str(served.dirs["fused-r2"]),
                              "base_model_name": "the-base"})  # fmt: skip
    argv = [str(served.root / "model"), "--served-model-name", BASE, "--api-key", KEY,
            "--moe-backend", "reference", "--max-num-seqs", "3", "--max-loras", "3",
            "--enable-lora", "--enable-runtime-lora", "--allowed-local-lora-path",
            str(served.root), "--chat-template", str(served.root / "template.jinja"),
            "--shutdown-timeout", "0", "--lora-modules",
            f"fused-r8={served.dirs['fused-r8']}", json_module]  # fmt: skip
    server = sf.start(argv, served.root / "server.log")
    yield server
    server.stop()  # the Ctrl-C test stopped it already; a failure before that lands here


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, route: str, body=None, content: bytes | None = None, timeout=60.0):
    headers = AUTH | {"Content-Type": "application/json"}
    if content is None:
        content = json.dumps(body).encode()
    return httpx.post(server.url + route, content=content, headers=headers, timeout=timeout)


def ids(served, text: str) -> list[int]:
    return served.tokenizer(text)["input_ids"]


def words(count: int, rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(1, 96)}" for _ in range(count))


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                     if line and not line.startswith("#"))}  # fmt: skip


def greedy_ok(served, client, rng) -> None:
    """A greedy request equals HF + PEFT: the server answers correctly."""
    prompt = words(4, rng)
    out = client.completions.create(model="fused-r8", prompt=prompt, max_tokens=3, temperature=0)
    assert out.choices[0].text == sf.truth_text(served, "fused-r8", ids(served, prompt), 3)


# ---- one request used to stop every other one ----------------------------------------------


@pytest.mark.parametrize("seed_value", [2**70, -(2**63) - 1], ids=["2^70", "-2^63-1"])
def test_a_seed_outside_int64_is_a_400_and_the_server_serves_on(served, server, client,
                                                                seed_value):  # fmt: skip
    body = {"model": "fused-r8", "prompt": "w1 w2", "max_tokens": 2, "seed": seed_value}
    got = post(server, "/v1/completions", body)
    assert got.status_code == 400 and got.json()["error"]["param"] == "seed", got.text
    greedy_ok(served, client, random.Random(seed_value % 1000))
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_a_tiny_temperature_decodes_greedily_beside_running_streams(served, server, client,
                                                                     seed):  # fmt: skip
    """temperature 1e-300 once made the step's sampling fail and cut every running stream;
    below 1e-5 it is greedy (vLLM's rule), and the streams beside it run to their end."""
    rng = random.Random(seed)
    prompts = [words(3, rng) for _ in range(2)]
    texts: dict[int, list[str]] = {0: [], 1: []}

    def stream(i):
        for chunk in client.completions.create(model="fused-r8", prompt=prompts[i],
                                               max_tokens=40, temperature=0, stream=True):  # fmt: skip
            texts[i].append(chunk.choices[0].text)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    prompt = words(5, rng)
    for temperature in (1e-300, 1e-40, 1e-6):
        out = client.completions.create(model=BASE, prompt=prompt, max_tokens=4,
                                        temperature=temperature, seed=7)  # fmt: skip
        assert out.choices[0].text == sf.truth_text(served, BASE, ids(served, prompt), 4)
    for t in threads:
        t.join(120)
    for i in range(2):
        assert "".join(texts[i]) == sf.truth_text(served, "fused-r8", ids(served, prompts[i]), 40)


# ---- the fields clients send: served --------------------------------------------------------


def test_chat_max_completion_tokens_and_content_parts(served, client, seed):
    rng = random.Random(seed)
    a, b = words(2, rng), words(3, rng)
    parts = [{"type": "text", "text": a}, {"type": "text", "text": b}]
    out = client.chat.completions.create(model="fused-r8", temperature=0,
                                         messages=[{"role": "user", "content": parts}],
                                         max_completion_tokens=5)  # fmt: skip
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    # the --chat-template file renders the parts joined by a newline, as vLLM joins them
    rendered = f"w3 {a}\n{b} w8"
    assert out.choices[0].message.content == sf.truth_text(served, "fused-r8",
                                                           ids(served, rendered), 5)  # fmt: skip


def test_stream_options_include_usage(client):
    chunks = list(client.completions.create(model="fused-r2", prompt="w4 w5 w6", max_tokens=4,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


SAMPLING = [
    # (id, request fields, HF generate's): each compared with HF + PEFT alone
    ("repetition-penalty", dict(temperature=0, extra_body={"repetition_penalty": 1.7}),
     dict(repetition_penalty=1.7)),
    ("min-p-seeded", dict(temperature=0.9, seed=11, extra_body={"min_p": 0.2}),
     dict(do_sample=True, temperature=0.9, min_p=0.2, top_k=0)),
]  # fmt: skip


@pytest.mark.parametrize("case", SAMPLING, ids=[c[0] for c in SAMPLING])
def test_vllm_sampling_fields_equal_hf(served, client, case, seed):
    _, fields, hf = case
    prompt = words(5, random.Random(seed))
    out = client.completions.create(model="fused-r2", prompt=prompt, max_tokens=6, **fields)
    if "seed" in fields:
        torch.manual_seed(fields["seed"])
    assert out.choices[0].text == sf.truth_text(served, "fused-r2", ids(served, prompt), 6, **hf)


def test_a_list_of_prompts_gets_one_choice_each(served, client, seed):
    rng = random.Random(seed)
    texts = [words(rng.randrange(1, 6), rng) for _ in range(3)]
    tokens = [ids(served, t) for t in texts]
    for prompt in (texts, tokens):
        out = client.completions.create(model="fused-r8", prompt=prompt, max_tokens=3,
                                        temperature=0)  # fmt: skip
        assert [c.index for c in out.choices] == [0, 1, 2]
        for choice, t in zip(out.choices, tokens):
            assert choice.text == sf.truth_text(served, "fused-r8", t, 3)
        assert out.usage.completion_tokens == 9
    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(model="fused-r8", prompt=texts, max_tokens=3,
                                           temperature=0, stream=True):  # fmt: skip
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert [streamed[i] for i in range(3)] == [sf.truth_text(served, "fused-r8", t, 3)
                                               for t in tokens]  # fmt: skip


def test_response_ids_are_unique(client):
    made = {client.completions.create(model=BASE, prompt="w1", max_tokens=1).id for _ in range(3)}
    assert len(made) == 3 and all(len(i) > 20 and i.startswith("cmpl-") for i in made), made


# ---- bodies refused: a 4xx OpenAI error object naming the field -----------------------------

BAD = [
    # (id, route, body or raw bytes, status, words in the message)
    ("unknown-field", "completions", {"frobnicate": 1}, 400, ["frobnicate"]),
    ("logprobs-21", "completions", {"logprobs": 21}, 400, ["logprobs"]),
    ("chat-echo", "chat/completions", {"messages": [{"role": "user", "content": "w1"}],
     "echo": True}, 400, ["echo"]),
    ("n-0", "completions", {"n": 0}, 400, ["'n'"]),
    ("max-tokens-true", "completions", {"max_tokens": True}, 400, ["max_tokens"]),
    ("stream-yes", "completions", {"stream": "yes"}, 400, ["stream"]),
    ("stop-empty", "completions", {"stop": ""}, 400, ["stop", "non-empty"]),
    ("stop-list-empty", "completions", {"stop": ["w3", ""]}, 400, ["stop"]),
    ("stream-options-no-stream", "completions", {"stream_options": {"include_usage": True}},
     400, ["stream_options"]),
    ("stop-token-out-of-vocab", "completions", {"stop_token_ids": [10**6]}, 400,
     ["stop_token_ids", "1000000"]),
    ("token-out-of-range", "completions", {"prompt": [5, 999]}, 400, ["999"]),
    ("empty-prompt-list", "completions", {"prompt": []}, 400, ["prompt"]),
    ("mixed-prompt-list", "completions", {"prompt": [1, "w1"]}, 400, ["prompt", "list[int]"]),
    ("too-long-in-flag-words", "completions", {"max_tokens": 5000}, 400,
     ["max_tokens = 5000", "--max-model-len 4096"]),
    ("lone-surrogate", "completions", b'{"model": "fused-r8", "prompt": "w1 \\ud800"}', 400,
     ["prompt", "U+D800"]),
    ("not-utf8", "completions", b'{"model": "fused-r8", "prompt": "\xff\xfe"}', 400, ["UTF-8"]),
    ("nan-temperature", "completions", b'{"model": "fused-r8", "prompt": "w1", "temperature": NaN}',
     400, ["temperature"]),
    ("not-an-object", "completions", b"[1, 2]", 400, ["body"]),
    ("truncated", "completions", b'{"model": "fused-r8", "pro', 400, ["JSON"]),
    ("nested", "completions", b"[" * 100000 + b"]" * 100000, 400, []),
    ("chat-image-part", "chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, ["image_url"]),
    ("chat-surrogate", "chat/completions",
     b'{"model": "fused-r8", "messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     ["messages.0.content", "U+DFFF"]),
    ("chat-limits-disagree", "chat/completions", {"messages": [{"role": "user", "content": "w1"}],
     "max_tokens": 3, "max_completion_tokens": 4}, 400, ["max_completion_tokens"]),
    ("no-route", "nothing", {}, 404, ["nothing"]),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_bodies_get_an_openai_error_object(server, case):
    _, route, body, status, words_ = case
    if isinstance(body, dict):
        body = {"model": "fused-r8", "prompt": "w1 w2", "max_tokens": 2} | body
        if route == "chat/completions":
            body.pop("prompt")
    got = post(server, f"/v1/{route}", content=body if isinstance(body, bytes) else None,
               body=body)  # fmt: skip
    assert got.status_code == status, got.text
    error = got.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert all(w in error["message"] for w in words_), error["message"]


def test_docs_are_closed_under_an_api_key(server):
    for route in ("/docs", "/redoc", "/openapi.json"):
        got = httpx.get(server.url + route)
        assert got.status_code == 404 and "error" in got.json(), route
    assert httpx.get(server.url + "/metrics").status_code == 200  # probes carry no key


# ---- runtime loads: confined, and silent about the filesystem -------------------------------


def test_runtime_loads_are_confined_and_do_not_reveal_paths(served, server, client, tmp_path):
    def load(name, path):
        return post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    outside = tmp_path / "outside"
    outside.mkdir()
    (served.root / "link-out").symlink_to(served.dirs["fused-r8"].parent.parent)
    (served.root / "empty").mkdir(exist_ok=True)
    refused = [
        # (lora_name, lora_path, status, words)
        (BASE, "fused-r4-attn", 400, ["base model's name"]),
        ("x", str(served.dirs["fused-r4-attn"]) + "\x00", 400, ["NUL"]),
        ("x", str(outside), 403, ["--allowed-local-lora-path"]),
        ("x", "../" + served.root.name + "/../outside", 403, ["--allowed-local-lora-path"]),
        ("x", "link-out", 403, ["--allowed-local-lora-path"]),
    ]
    for name, path, status, words_ in refused:
        got = load(name, path)
        assert got.status_code == status and all(w in got.json()["error"]["message"]
                                                 for w in words_), (path, got.text)  # fmt: skip
    # a folder that exists and one that does not read the same (only the path given differs)
    missing, empty = load("x", "no-such-dir").json(), load("x", "empty").json()
    assert missing["error"]["message"].replace("'no-such-dir'", "P") == empty["error"][
        "message"].replace("'empty'", "P")  # fmt: skip
    assert str(served.root) not in missing["error"]["message"]
    # a path relative to the allowed root loads and serves
    assert load("attn", "fused-r4-attn").status_code == 200
    out = client.completions.create(model="attn", prompt="w5 w6", max_tokens=2, temperature=0)
    assert out.choices[0].text == sf.truth_text(served, "fused-r4-attn", ids(served, "w5 w6"), 2)
    listed = {m.id: m for m in client.models.list().data}
    assert listed["fused-r2"].parent == "the-base" and listed["attn"].parent == BASE
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "attn"}).status_code == 200


def test_a_stream_whose_adapter_is_unloaded_while_queued_gets_a_clean_400(served, server,
                                                                          client):  # fmt: skip
    """The stream's response starts once its row runs: an unload while it waits is a 400
    the client reads (it was a 200 and then a dropped connection)."""
    assert post(server, "/v1/load_lora_adapter",
                {"lora_name": "temp", "lora_path": "fused-r4-attn"}).status_code == 200  # fmt: skip
    fillers = [client.completions.create(model=BASE, prompt="w1", max_tokens=3000, stream=True)
               for _ in range(3)]  # fmt: skip
    for f in fillers:  # every row (--max-num-seqs 3) runs
        next(iter(f))
    outcome: list = []

    def queued_stream():
        try:
            list(client.completions.create(model="temp", prompt="w2", max_tokens=2, stream=True))
            outcome.append("served")
        except Exception as err:  # the outcome under test
            outcome.append(err)

    thread = threading.Thread(target=queued_stream)
    thread.start()
    for _ in range(400):  # bounded (20 s): until it waits for a row
        if metrics(server)["moelora_requests_queued"] >= 1:
            break
        time.sleep(0.05)
    assert metrics(server)["moelora_requests_queued"] >= 1
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "temp"}).status_code == 200
    for f in fillers:
        f.close()  # the clients leave: their rows free and the queued request is admitted
    thread.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], openai.BadRequestError), outcome
    assert "temp" in outcome[0].body["message"]


# ---- bodies too large or too slow -----------------------------------------------------------


def test_large_bodies_are_refused_at_once_and_nothing_freezes(server):
    huge = json.dumps({"model": BASE, "prompt": "w1 " * 3_500_000}).encode()  # 10 MB
    long = json.dumps({"model": BASE, "prompt": "w1 " * 300_000}).encode()  # 900 kB, > 4096 tokens
    answers: list = []

    def send(body):
        answers.append(post(server, "/v1/completions", content=body, timeout=60))

    threads = [threading.Thread(target=send, args=(b,)) for b in (huge, huge, huge, long)]
    start = time.monotonic()
    for t in threads:
        t.start()
    health = []
    while any(t.is_alive() for t in threads) and time.monotonic() - start < 30:
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        health.append(time.monotonic() - t0)
    for t in threads:
        t.join(60)
    assert sorted(a.status_code for a in answers) == [400, 413, 413, 413], [a.text for a in answers]
    assert time.monotonic() - start < 10 and max(health, default=0) < 1.0, health
    assert "--max-model-len 4096" in next(a for a in answers if a.status_code == 400).text


# ---- a fuzz of request bodies ---------------------------------------------------------------

ABSENT = object()
VALUES = {
    "model": [BASE, "fused-r8", "fused-r2", "nope", "", 5, None, ["x"], "m" * 5000],
    "max_tokens": [ABSENT, None, 0, 1, 3, -1, True, "5", 1e9, 2**64, 3.5, 10**30],
    "temperature": [ABSENT, 0, 0.7, 1e-300, -1, 3, "hot", None, True, 1e308, 2],
    "top_p": [ABSENT, 0, 0.5, 1, 1.5, -0.1, "x", None],
    "top_k": [ABSENT, -2, -1, 0, 5, 10**12, 2.5, "k"],
    "min_p": [ABSENT, 0, 0.3, 1, 1.2, -1, None],
    "repetition_penalty": [ABSENT, 0, 1, 1.3, 0.5, -1, 1e9, "x"],
    "seed": [ABSENT, 0, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**70, "x", 1.0, None],
    "stop": [ABSENT, "", [""], "w3", ["w3", "w4"], [1], ["w5"] * 100, None, 5, "\ud800"],
    "stop_token_ids": [ABSENT, [1], [10**9], [-1], "x", [], None],
    "stream": [ABSENT, True, False, "yes", 1, None],
    "stream_options": [ABSENT, {"include_usage": True}, {"continuous_usage_stats": True},
                       {"x": 1}, "yes", None],
    "n": [ABSENT, 1, 2, 0, -1, None],
    "min_tokens": [ABSENT, 0, 2, 10**9, -1],
    "ignore_eos": [ABSENT, True, False, "x"],
    "logprobs": [ABSENT, None, False, 1, 0, True],
    "echo": [ABSENT, False, True, "no"],
    "user": [ABSENT, "u", 5, None],
    "best_of": [ABSENT, 1, 2, None],
    "presence_penalty": [ABSENT, 0, 0.5, None],
    "response_format": [ABSENT, {"type": "text"}, {"type": "json_object"}, None],
    "frobnicate": [ABSENT, ABSENT, 1],
}  # fmt: skip
PROMPTS = ["w1 w2", "", [], [1, 2, 3], [[1, 2], [3]], [[]], [-1], [10**6], ["w1", "w2 w3"], 5,
           None, {"a": 1}, "w5 " * 50, [1.5], True, "\ud800x", "w9 " * 5000]  # fmt: skip
CONTENTS = ["w1 w2", "", [{"type": "text", "text": "w3"}], [{"type": "image_url"}], 5, None,
            [{"type": "text"}], [], "\udc00", {"x": 1}]  # fmt: skip
RAW = [b"", b"{", b"null", b'"x"', b"[]", b"\xff\xfe\xfd", b'{"model": NaN}', b"1e999",
       b'{"model": "base", "prompt": "w1", "max_tokens": 1e999}', b"{" * 50000]  # fmt: skip


def fuzz_body(rng: random.Random) -> tuple[str, bytes]:
    """A raw malformed body (8%), or a valid body with 0-6 fields set to values drawn from
    VALUES / PROMPTS / CONTENTS (valid and hostile alike), so that both the refusals and the
    engine are reached."""
    chat = rng.random() < 0.4
    route = "chat/completions" if chat else "completions"
    if rng.random() < 0.08:
        return route, rng.choice(RAW)
    body: dict = {"model": rng.choice([BASE, "fused-r8", "fused-r2"]), "max_tokens": 4}
    if chat:
        body["messages"] = [{"role": "user", "content": "w1 w2"}]
    else:
        body["prompt"] = "w3 w4 w5"
    for name in rng.sample(sorted(VALUES), rng.choice([0, 1, 1, 2, 3, 6])):
        value = rng.choice(VALUES[name])
        if value is ABSENT:
            body.pop(name, None)
        else:
            body[name] = value
    if rng.random() < 0.3:
        if chat:
            body["messages"] = [{"role": rng.choice(["user", "system", "assistant", "robot", 3]),
                                 "content": rng.choice(CONTENTS)}
                                for _ in range(rng.randrange(0, 4))]  # fmt: skip
        else:
            body["prompt"] = rng.choice(PROMPTS)
    if body.get("max_tokens") is None:  # a chat body left at the default runs ~4000 tokens
        body["max_tokens"] = 4
    text = json.dumps(body, allow_nan=True)
    return route, text.encode("utf-8", "surrogatepass")


def test_a_fuzz_of_2000_bodies_gets_no_5xx_no_hang_and_the_server_answers_after(served, server,
                                                                                 client, seed):  # fmt: skip
    rng = random.Random(seed)
    bodies = [fuzz_body(rng) for _ in range(2000)]
    statuses: list[int] = []
    faults: list = []

    def send(item):
        route, content = item
        headers = AUTH | {"Content-Type": "application/json"}
        try:
            with httpx.stream("POST", f"{server.url}/v1/{route}", content=content,
                              headers=headers, timeout=120) as got:  # fmt: skip
                text = b"".join(got.iter_bytes()).decode()
        except Exception as err:  # a hang (timeout) or a torn connection
            faults.append((content[:200], repr(err)))
            return
        statuses.append(got.status_code)
        stream = got.headers.get("content-type", "").startswith("text/event-stream")
        torn = stream and not text.rstrip().endswith("data: [DONE]")
        errored = stream and '"code": 5' in text
        if got.status_code >= 500 or torn or errored:
            faults.append((content[:200], got.status_code, text[-300:]))
        elif not stream and "error" not in json.loads(text) and got.status_code != 200:
            faults.append((content[:200], got.status_code, text[:300]))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(send, bodies))
    assert not faults, faults[:5]
    assert len(statuses) == 2000 and set(statuses) <= {200, 400, 404, 413}, set(statuses)
    assert statuses.count(200) > 400  # the fuzz reaches the engine, not only the validator
    greedy_ok(served, client, rng)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_metrics_account_for_every_request(server):
    """Idle: every started request ended under exactly one reason; nothing runs or waits."""
    for _ in range(200):  # bounded (10 s): the last cancellations reach the engine
        m = metrics(server)
        ended = sum(v for k, v in m.items() if k.startswith("moelora_requests_total{"))
        if ended == m["moelora_requests_started_total"] and m["moelora_rows_running"] == 0:
            break
        time.sleep(0.05)
    assert ended == m["moelora_requests_started_total"] > 0, m
    assert m["moelora_rows_running"] == 0 and m["moelora_requests_queued"] == 0
    assert m['moelora_requests_total{finish_reason="cancelled"}'] >= 3  # the fillers above
    # the stream whose adapter was unloaded while it waited: started, then failed
    assert m['moelora_requests_total{finish_reason="error"}'] >= 1


# ---- exit codes -----------------------------------------------------------------------------


def test_a_port_in_use_is_refused_before_the_model_loads(served, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        code = sf.run_child(["serve", str(served.root / "model"), "--port", str(port)],
                            tmp_path / "taken.log", timeout=60)  # fmt: skip
    log = (tmp_path / "taken.log").read_text()
    assert code == 2 and "--port" in log and "Traceback" not in log, log
    assert "moe backend" not in log and time.monotonic() - start < 30  # nothing was loaded


def test_ctrl_c_cuts_running_rows_with_openai_errors_and_exits_0(server, client):
    """--shutdown-timeout 0: rows running at Ctrl-C are cancelled at once; a whole request
    reads a 503 error object, a stream an error event and then [DONE]."""
    results: dict[str, object] = {}

    def whole():
        results["whole"] = post(server, "/v1/completions",
                                {"model": BASE, "prompt": "w1", "max_tokens": 3000}, timeout=60)  # fmt: skip

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, timeout=60,
                          json={"model": "fused-r8", "prompt": "w2", "max_tokens": 3000,
                                "stream": True}) as got:  # fmt: skip
            results["stream"] = [line for line in got.iter_lines() if line]

    threads = [threading.Thread(target=whole), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    for _ in range(400):  # bounded (20 s): until both rows run
        if metrics(server)["moelora_rows_running"] == 2:
            break
        time.sleep(0.05)
    assert server.stop(sig=signal.SIGINT) == 0, server.log.read_text()
    for t in threads:
        t.join(60)
    whole_answer = results["whole"]
    assert whole_answer.status_code == 503 and "shut down" in whole_answer.json()["error"][
        "message"]  # fmt: skip
    lines = results["stream"]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == 503
    log = server.log.read_text()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log


def test_sigint_while_loading_is_one_line_and_exit_130(served, tmp_path):
    env = os.environ | {"PYTHONPATH": str(sf.TESTS.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "moelora", "serve", str(served.root / "model"),
                             "--port", str(sf.free_port())], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        time.sleep(1.5)  # inside the imports / the load
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:  # a server that ignored the signal is not left running
        proc.kill()
    assert proc.returncode in (130, 0) and "Traceback" not in out, (proc.returncode, out)


def test_the_public_names_import_lazily_and_all_resolve():
    """`import moelora` imports no submodule (Ctrl-C while the command line loads is then
    caught), and every name of __all__ resolves on first use."""
    code = ("import sys, moelora; heavy = [m for m in sys.modules if m.startswith('moelora.')]; "
            "assert not heavy, heavy; [getattr(moelora, n) for n in moelora.__all__]; print('ok')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=os.environ | {"PYTHONPATH": str(sf.TESTS.parent)}, timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
