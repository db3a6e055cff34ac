"""What evaluation harnesses and clients send `moelora serve` (issue 38, item 5), through the
official `openai` client against a real server process: echo with logprobs, max_tokens 0,
logprobs of generated tokens, vLLM's prompt_logprobs, batches of token-id lists and of
strings, chat logprobs with top_logprobs, `n` with seeds, vLLM's /tokenize, /detokenize and
/tokenizer_info, usage in the last stream chunk, and the values still refused (400 naming
them). Every logprob equals HF + PEFT's log_softmax of the model's logits (fp32, 1e-5);
every greedy text equals HF + PEFT generating the prompt alone. One server."""

from __future__ import annotations

import json
import random

import httpx2 as httpx
import openai
import pytest
import serve_fixtures as sf
import torch

pytestmark = pytest.mark.filterwarnings("ignore")

KEY = "sk-logprobs"
BASE = "base"
ADAPTERS = ["fused-r8", "fused-r4-attn"]  # experts only; experts + attention modules
ATOL = 1e-5  # fp32 tiny model: the served logits and HF + PEFT's agree to ~1e-6


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_seed):
    return sf.build(tmp_path_factory.mktemp("logprobs"), seed=model_seed)


@pytest.fixture(scope="module")
def server(served):
    argv = [str(served.root / "model"), "--served-model-name", BASE, "--api-key", KEY,
            "--moe-backend", "reference", "--max-num-seqs", "8",
            "--lora-modules", *[f"{n}={served.dirs[n]}" for n in ADAPTERS]]  # fmt: skip
    server = sf.start(argv, served.root / "server.log")
    yield server
    assert server.stop() == 0, server.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def words(count: int, rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(1, 96)}" for _ in range(count))


def ids_of(served, text: str) -> list[int]:
    return served.tokenizer(text)["input_ids"]


def truth_logprobs(served, model: str, ids: list[int]) -> torch.Tensor:
    """HF + PEFT alone: logprobs [len(ids) - 1, V] of position i + 1 given ids[: i + 1]
    (one forward over ids[:-1], fp32 log_softmax of its logits)."""
    module = served.truths.get(model, served.base)
    with torch.no_grad():
        logits = module(input_ids=torch.tensor([ids[:-1]])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def token_id(served, text: str) -> int:
    return served.tokenizer.convert_tokens_to_ids(text)


def check_position(served, truth: torch.Tensor, token: int, logprob: float, top: dict, n: int):
    """One scored position against the truth row [V]: the token's logprob, and `top` holds
    the token and the n most likely tokens (n + 1 entries when it is not among them)."""
    assert abs(logprob - truth[token].item()) < ATOL, (logprob, truth[token].item())
    ids = {token_id(served, t): lp for t, lp in top.items()}
    ref = set(torch.topk(truth, n).indices.tolist()) | {token}
    assert set(ids) == ref, (sorted(ids), sorted(ref))
    for t, lp in ids.items():
        assert abs(lp - truth[t].item()) < ATOL, (t, lp, truth[t].item())


def check_completion_logprobs(served, model, prompt_ids, choice, n: int, echo: bool):
    """A completions choice's logprobs object against HF + PEFT over prompt + its tokens."""
    lp = choice.logprobs
    gen = [token_id(served, t) for t in lp.tokens[len(prompt_ids) if echo else 0 :]]
    full = prompt_ids + gen
    truth = truth_logprobs(served, model, full) if len(full) > 1 else None
    start = 0 if echo else len(prompt_ids)
    tokens = full[start:]
    assert [token_id(served, t) for t in lp.tokens] == tokens
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(tokens))]
    assert lp.text_offset == offsets
    for k, (token, value, top) in enumerate(zip(tokens, lp.token_logprobs, lp.top_logprobs)):
        at = start + k  # position in full
        if at == 0:  # the prompt's first token: nothing scores it
            assert value is None and top is None
            continue
        check_position(served, truth[at - 1], token, value, top, n)
    return gen


# ---- completions -------------------------------------------------------------------------

CASES = [
    # (id, model, prompt words, max_tokens, logprobs N, echo): the edge each covers
    ("echo-adapter-lm-eval", "fused-r8", 5, 1, 1, True),  # lm-eval's loglikelihood body
    ("echo-attn-top3", "fused-r4-attn", 4, 3, 3, True),  # attention LoRA, 3 tokens
    ("echo-base-top0", BASE, 3, 2, 0, True),  # logprobs 0: the token's own entry only
    ("echo-one-token-prompt", "fused-r8", 1, 2, 2, True),  # the prompt's only token is null
    ("no-echo-adapter", "fused-r8", 4, 4, 2, False),  # generated tokens only
    ("no-echo-base-top20", BASE, 3, 3, 20, False),  # vLLM's largest N
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_completion_logprobs_equal_hf_peft(served, client, seed, case):
    _, model, count, max_tokens, n, echo = case
    prompt = words(count, random.Random(seed))
    ids = ids_of(served, prompt)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                    logprobs=n, echo=echo, temperature=0)  # fmt: skip
    choice = out.choices[0]
    gen = check_completion_logprobs(served, model, ids, choice, n, echo)
    truth = sf.truth_text(served, model, ids, max_tokens)
    assert choice.text == (prompt if echo else "") + truth
    assert len(gen) == max_tokens and out.usage.completion_tokens == max_tokens
    # vLLM's prompt_logprobs field comes with echo + logprobs (it computes them for echo)
    extra = choice.model_extra.get("prompt_logprobs")
    assert (extra is not None) == echo


@pytest.mark.parametrize("model", ["fused-r8", BASE])
def test_echo_with_max_tokens_0_scores_the_prompt_alone(served, client, seed, model):
    prompt = words(6, random.Random(seed))
    ids = ids_of(served, prompt)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=0, logprobs=2,
                                    echo=True)  # fmt: skip
    choice = out.choices[0]
    assert choice.text == prompt
    gen = check_completion_logprobs(served, model, ids, choice, 2, echo=True)
    assert gen == [] and len(choice.logprobs.tokens) == len(ids)


def test_prompt_logprobs_field_as_vllm_writes_it(served, client, seed):
    """vLLM's extra `prompt_logprobs: N`: null, then {id: {logprob, rank, decoded_token}} with
    the prompt token first (its rank in the whole vocabulary), then the top N, ranks 1..N."""
    prompt = words(5, random.Random(seed))
    ids = ids_of(served, prompt)
    out = client.completions.create(model="fused-r8", prompt=prompt, max_tokens=1,
                                    extra_body={"prompt_logprobs": 3}, temperature=0)  # fmt: skip
    got = out.choices[0].model_extra["prompt_logprobs"]
    assert out.choices[0].logprobs is None and got[0] is None and len(got) == len(ids)
    truth = truth_logprobs(served, "fused-r8", ids)
    for i, position in enumerate(got[1:]):
        row, token = truth[i], ids[i + 1]
        assert next(iter(position)) == str(token)  # the prompt token first
        top = torch.topk(row, 3)
        want = {str(t): r + 1 for r, t in enumerate(top.indices.tolist())}
        want[str(token)] = int((row > row[token]).sum()) + 1
        assert {k: v["rank"] for k, v in position.items()} == want
        for k, v in position.items():
            assert abs(v["logprob"] - row[int(k)].item()) < ATOL
            assert v["decoded_token"] == served.tokenizer.decode([int(k)])


BATCHES = [
    # (id, prompt form): lm-eval's default tokenized_requests=True sends token-id lists
    ("token-id-lists", "ids"),
    ("strings", "text"),
]


@pytest.mark.parametrize("case", BATCHES, ids=[c[0] for c in BATCHES])
def test_a_batch_of_prompts_gets_one_choice_each_in_order(served, client, seed, case):
    rng = random.Random(seed)
    texts = [words(rng.randrange(2, 7), rng) for _ in range(3)]
    ids = [ids_of(served, t) for t in texts]
    prompt = ids if case[1] == "ids" else texts
    out = client.completions.create(model="fused-r8", prompt=prompt, max_tokens=1, logprobs=1,
                                    echo=True, temperature=0)  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2]
    for i, choice in enumerate(out.choices):
        check_completion_logprobs(served, "fused-r8", ids[i], choice, 1, echo=True)
        assert choice.text == texts[i] + sf.truth_text(served, "fused-r8", ids[i], 1)
    assert out.usage.prompt_tokens == sum(map(len, ids))


def test_streamed_echo_logprobs_concatenate_to_the_whole_and_usage_comes_last(client, seed):
    prompt = words(4, random.Random(seed))
    kw = dict(model="fused-r4-attn", prompt=prompt, max_tokens=5, logprobs=2, echo=True,
              temperature=0)  # fmt: skip
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    *parts, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert all(c.usage is None for c in parts)
    assert "".join(c.choices[0].text for c in parts) == whole.text
    for field in ("tokens", "token_logprobs", "top_logprobs"):
        streamed = [x for c in parts for x in getattr(c.choices[0].logprobs, field)]
        assert streamed == getattr(whole.logprobs, field), field
    # streamed offsets count the text sent before each chunk (vLLM's)
    assert parts[0].choices[0].logprobs.text_offset[0] == 0


# ---- chat ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_with_top_logprobs_equal_hf_peft(served, client, seed, stream):
    content = words(3, random.Random(seed))
    messages = [{"role": "user", "content": content}]
    kw = dict(model="fused-r8", messages=messages, max_tokens=3, logprobs=True, top_logprobs=2,
              temperature=0)  # fmt: skip
    if stream:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        items = [x for c in chunks if c.choices and c.choices[0].logprobs
                 for x in c.choices[0].logprobs.content]  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        out = client.chat.completions.create(**kw)
        items, text = out.choices[0].logprobs.content, out.choices[0].message.content
    prompt = served.tokenizer(served.tokenizer.apply_chat_template(messages, tokenize=False,
                              add_generation_prompt=True))["input_ids"]  # fmt: skip
    gen = [token_id(served, item.token) for item in items]
    assert text == sf.truth_text(served, "fused-r8", prompt, 3) and len(gen) == 3
    truth = truth_logprobs(served, "fused-r8", prompt + gen)
    for k, item in enumerate(items):
        row = truth[len(prompt) - 1 + k]
        assert bytes(item.bytes) == item.token.encode()
        top = {t.token: t.logprob for t in item.top_logprobs}
        assert len(item.top_logprobs) == 2  # greedy: the token is the top one
        check_position(served, row, gen[k], item.logprob, top | {item.token: item.logprob}, 2)


# ---- n and seeds --------------------------------------------------------------------------


def test_n_choices_are_numbered_prompt_major_and_seeded_reproducibly(client, seed):
    """n = 3 over 2 prompts: index = prompt * 3 + j; choice j draws what a single request
    with seed + j draws (vLLM seeds a request's samples so); the same body twice, the same
    choices."""
    rng = random.Random(seed)
    prompts = [words(3, rng), words(4, rng)]
    body = dict(model="fused-r8", prompt=prompts, max_tokens=4, n=3, temperature=1.0,
                seed=seed)  # fmt: skip
    first = client.completions.create(**body)
    again = client.completions.create(**body)
    assert [c.index for c in first.choices] == list(range(6))
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    for p, prompt in enumerate(prompts):
        for j in range(3):
            alone = client.completions.create(model="fused-r8", prompt=prompt, max_tokens=4,
                                              temperature=1.0, seed=seed + j)  # fmt: skip
            assert texts[p * 3 + j] == alone.choices[0].text, (p, j)
    assert len(set(texts[:3])) > 1  # different seeds draw differently (4 tokens of 96)
    assert first.usage.prompt_tokens == 7 and first.usage.completion_tokens == 24


def test_chat_n_streams_every_choice(client, seed):
    messages = [{"role": "user", "content": words(2, random.Random(seed))}]
    chunks = list(client.chat.completions.create(model=BASE, messages=messages, max_tokens=3,
                                                 n=2, seed=seed, stream=True))  # fmt: skip
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    whole = client.chat.completions.create(model=BASE, messages=messages, max_tokens=3, n=2,
                                           seed=seed)  # fmt: skip
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]


# ---- tokenizer routes ----------------------------------------------------------------------


def call(server, method: str, route: str, body=None, key: str | None = KEY):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.request(method, server.url + route, json=body, headers=headers, timeout=30)


def test_tokenize_and_detokenize_as_vllm(served, server, seed):
    text = words(6, random.Random(seed))
    got = call(server, "POST", "/tokenize", {"model": "fused-r8", "prompt": text}).json()
    assert got == {"count": 6, "max_model_len": 128, "tokens": ids_of(served, text),
                   "token_strs": None}  # fmt: skip
    messages = [{"role": "user", "content": text}]
    chat = call(server, "POST", "/tokenize", {"messages": messages}).json()
    rendered = served.tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=True)  # fmt: skip
    assert chat["tokens"] == ids_of(served, rendered)
    back = call(server, "POST", "/detokenize", {"tokens": got["tokens"]}).json()
    assert back == {"prompt": text}


def test_tokenizer_info_as_lm_eval_reads_it(served, server):
    info = call(server, "GET", "/tokenizer_info").json()
    assert "eos_token" in info and info["tokenizer_class"] == type(served.tokenizer).__name__
    assert info["chat_template"] == sf.CHAT_TEMPLATE and info["pad_token"] == "<pad>"
    assert call(server, "GET", "/tokenizer_info", key=None).status_code == 401


# ---- refused: vLLM's 400 error object naming the field -------------------------------------

REFUSED = [
    # (id, route, body fields, param, words in the message)
    ("logprobs-over-20", "completions", {"logprobs": 21}, "logprobs", ["21"]),
    ("logprobs-bool", "completions", {"logprobs": True}, "logprobs", ["logprobs"]),
    ("max-tokens-0-no-echo", "completions", {"max_tokens": 0}, "max_tokens", ["echo"]),
    ("prompt-logprobs-stream", "completions", {"prompt_logprobs": 1, "stream": True},
     "prompt_logprobs", ["stream"]),
    ("n-0", "completions", {"n": 0}, "n", ["n"]),
    ("n-over-max", "completions", {"n": 129}, "n", ["128"]),
    ("best-of-2", "completions", {"best_of": 2}, "best_of", ["not supported"]),
    ("chat-echo", "chat/completions", {"echo": True}, "echo", ["not supported"]),
    ("chat-prompt-logprobs", "chat/completions", {"prompt_logprobs": 1}, "prompt_logprobs",
     ["not supported"]),
    ("chat-top-without-logprobs", "chat/completions", {"top_logprobs": 2}, "top_logprobs",
     ["logprobs = true"]),
    ("chat-logprobs-int", "chat/completions", {"logprobs": 1}, "logprobs", ["logprobs"]),
    ("response-format-type", "completions", {"response_format": {"type": "yaml"}},
     "response_format.type", ["yaml"]),
    ("response-format-no-schema", "completions", {"response_format": {"type": "json_schema"}},
     "response_format", ["json_schema"]),
    ("tokenize-both", "/tokenize", {"prompt": "w1", "messages": [{"role": "user",
     "content": "w1"}]}, "body", ["exactly one"]),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [1, 10**6]}, "tokens", ["1000000"]),
]  # fmt: skip


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_values_not_served_are_refused_naming_them(server, case):
    _, route, fields, param, words_ = case
    if route.startswith("/"):
        body, path = fields, route
    else:
        body = {"model": "fused-r8", "max_tokens": 2} | fields
        body |= {"messages": [{"role": "user", "content": "w1"}]} if "chat" in route else (
            {"prompt": "w1 w2"})  # fmt: skip
        path = f"/v1/{route}"
    got = call(server, "POST", path, body)
    error = got.json()["error"]
    assert got.status_code == 400 and error["code"] == 400, got.text
    assert error["type"] == "BadRequestError" and error["param"] == param, error
    assert all(w in error["message"] for w in words_), error["message"]
    assert json.dumps(got.json())  # a plain JSON error object
