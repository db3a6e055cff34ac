"""response_format (issue 38, item 5): `json_object` and `json_schema` through xgrammar, a
mask on the constrained row only, against a real `moelora serve` on a tiny model whose
byte-level BPE tokenizer (trained here, offline) can spell JSON. Every constrained greedy
answer equals HF + PEFT generating the prompt alone under xgrammar's own transformers
logits processor for the same grammar; unconstrained rows of the same moment are unchanged
(equal to HF + PEFT unmasked); a finished answer parses and follows its schema. One
server."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import serve_fixtures as sf
import torch
import xgrammar as xgr
from xgrammar.contrib.hf import LogitsProcessor

from moelora.hf import toy

pytestmark = pytest.mark.filterwarnings("ignore")

ADAPTER = "fused-r8"
VOCAB = 320  # the model's; the tokenizer has fewer (xgrammar masks the rest)
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}


def bpe_tokenizer():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    core = ByteLevelBPETokenizer()
    corpus = ['{"color": "red", "ok": true}', '{"a": [1, 2.5, null, false], "b": "x y"}',
              "the quick brown fox jumps over the lazy dog"] * 20  # fmt: skip
    core.train_from_iterator(corpus, vocab_size=300, min_frequency=1, special_tokens=["<pad>"])
    return PreTrainedTokenizerFast(tokenizer_object=core._tokenizer, pad_token="<pad>")


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_seed):
    root = tmp_path_factory.mktemp("structured")
    seed = model_seed
    base = toy.build_model("qwen3_moe", seed=seed, vocab_size=VOCAB)
    base.generation_config.eos_token_id = None  # no end token: the grammar ends the rows
    base.save_pretrained(root / "model")
    tok = bpe_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(root / "model")
    kw = toy.demo_adapters(base)[ADAPTER]
    truth = toy.write_peft_adapter(base, root / ADAPTER, seed=seed + 1, **kw)
    return sf.Served(root, base, {ADAPTER: truth}, {ADAPTER: root / ADAPTER}, tok)


@pytest.fixture(scope="module")
def client(served):
    argv = [str(served.root / "model"), "--served-model-name", "base", "--moe-backend",
            "reference", "--max-num-seqs", "4", "--lora-modules",
            f"{ADAPTER}={served.dirs[ADAPTER]}"]  # fmt: skip
    server = sf.start(argv, served.root / "server.log")
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    assert server.stop() == 0, server.log.read_text()


def compiled(served, fmt: dict):
    info = xgr.TokenizerInfo.from_huggingface(served.tokenizer, vocab_size=VOCAB)
    compiler = xgr.GrammarCompiler(info)
    if fmt["type"] == "json_object":  # any JSON object
        return compiler.compile_json_schema('{"type": "object"}')
    return compiler.compile_json_schema(json.dumps(fmt["json_schema"]["schema"]))


def truth_ids(served, model, prompt: list[int], n: int, fmt: dict | None) -> list[int]:
    """HF + PEFT greedy, alone, under xgrammar's transformers logits processor."""
    module = served.truths.get(model, served.base)
    ids = torch.tensor([prompt])
    processors = [] if fmt is None else [LogitsProcessor(compiled(served, fmt))]
    with torch.no_grad():
        out = module.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                              max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0, logits_processor=processors)  # fmt: skip
    return out[0, len(prompt) :].tolist()


FORMATS = [
    # (id, response_format, model): a schema with enums (short, terminates) and any object
    ("schema-adapter", {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
     ADAPTER),
    ("schema-base", {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
     "base"),
    ("json-object-adapter", {"type": "json_object"}, ADAPTER),
]  # fmt: skip


@pytest.mark.parametrize("case", FORMATS, ids=[c[0] for c in FORMATS])
def test_constrained_rows_equal_hf_with_xgrammar_and_others_are_untouched(served, client, seed,
                                                                        case):  # fmt: skip
    _, fmt, model = case
    rng = random.Random(seed)
    text = rng.choice(["the fox", "a lazy dog", "quick brown"])
    prompt = served.tokenizer(text)["input_ids"]
    free_text = rng.choice(["jumps over", "the dog"])
    with ThreadPoolExecutor(2) as pool:  # a constrained row beside an unconstrained one
        asked = pool.submit(client.completions.create, model=model, prompt=text, max_tokens=48,
                            temperature=0, extra_body={"response_format": fmt}, logprobs=0)  # fmt: skip
        free = pool.submit(client.completions.create, model=model, prompt=free_text,
                           max_tokens=6, temperature=0)  # fmt: skip
        out, free_out = asked.result(), free.result()
    n = out.usage.completion_tokens
    # the server's text skips special tokens (vLLM's default), which a JSON string may hold
    truth = truth_ids(served, model, prompt, n, fmt)
    assert out.choices[0].text == served.tokenizer.decode(truth, skip_special_tokens=True)
    # the chosen tokens' logprobs (after the mask, as vLLM's) are finite
    assert all(-1e4 < lp <= 0 for lp in out.choices[0].logprobs.token_logprobs)
    free_ids = served.tokenizer(free_text)["input_ids"]
    want = served.tokenizer.decode(
        truth_ids(served, model, free_ids, 6, None), skip_special_tokens=True
    )
    assert free_out.choices[0].text == want
    if out.choices[0].finish_reason == "stop":  # the grammar matched whole
        value = json.loads(out.choices[0].text)
        assert isinstance(value, dict)
        if fmt["type"] == "json_schema":
            assert set(value) == {"color", "ok"} and value["color"] in {"red", "green", "blue"}
            assert isinstance(value["ok"], bool)
    else:
        assert out.choices[0].finish_reason == "length" and n == 48


def test_chat_json_schema_equals_hf_with_xgrammar(served, client, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
    messages = [{"role": "user", "content": random.Random(seed).choice(["the fox", "dog"])}]
    out = client.chat.completions.create(model=ADAPTER, messages=messages, max_tokens=48,
                                         temperature=0, response_format=fmt)  # fmt: skip
    rendered = served.tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=True)  # fmt: skip
    prompt = served.tokenizer(rendered)["input_ids"]
    want = truth_ids(served, ADAPTER, prompt, out.usage.completion_tokens, fmt)
    assert out.choices[0].message.content == served.tokenizer.decode(want, skip_special_tokens=True)


REFUSED = [
    # (id, response_format, words): schemas xgrammar refuses, formats not served
    ("bad-schema", {"type": "json_schema", "json_schema": {"name": "c", "schema": {
        "type": "no-such-type"}}}, ["could not be compiled"]),
    ("structural-tag", {"type": "structural_tag"}, ["structural_tag"]),
]  # fmt: skip


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_formats_not_served_are_400s_naming_response_format(client, case):
    _, fmt, words = case
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model="base", prompt="the", max_tokens=4, extra_body={"response_format": fmt}
        )
    error = caught.value.body
    assert error["param"].startswith("response_format"), error
    assert all(w in error["message"] for w in words), error["message"]


def test_without_xgrammar_a_response_format_is_a_400_naming_the_package(monkeypatch):
    """The `structured` extra missing: the body is refused before anything runs, naming the
    package and the extra to install; a body without response_format still prepares."""
    import importlib
    from types import SimpleNamespace

    from moelora.serve import protocol, structured
    from moelora.serve.context import ServeContext, ServeError

    real = importlib.import_module

    def no_xgrammar(name, *args):
        if name == structured.PACKAGE:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_xgrammar)
    engine = SimpleNamespace(vocab_size=96, max_len=64)
    ctx = ServeContext(SimpleNamespace(adapters=[]), SimpleNamespace(engine=engine),
                       sf.word_tokenizer(96), "base")  # fmt: skip
    body = {"model": "base", "prompt": "w1 w2", "max_tokens": 2}
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
    with pytest.raises(ServeError) as caught:
        ctx.prepare(protocol.CompletionRequest.model_validate(body | {"response_format": fmt}))
    error = caught.value
    assert error.status == 400 and error.param == "response_format"
    assert "'xgrammar'" in str(error) and "moelora[structured]" in str(error), str(error)
    assert len(ctx.prepare(protocol.CompletionRequest.model_validate(body)).choices) == 1
