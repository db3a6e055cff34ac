"""`moelora serve` on a model with linear-attention layers (a tiny Qwen3.5-MoE: Gated
DeltaNet layers around a full-attention one) on the decode runner, from a real server
process on 127.0.0.1 and the official `openai` client: requests sent together (prompts
chunked beside running decodes, rows preempted over too few blocks, each row's state kept
apart) answer what HF + PEFT give each alone; a prompt sent again reads its prefix from the
cache (a snapshot of the layers' states at its block boundary: prefix caching on) and answers the
same; the server exits 0 on SIGTERM."""

from __future__ import annotations

import random
import threading

import httpx2 as httpx
import openai
import pytest
import serve_fixtures as sf
import torch
from engine_helpers import QWEN35, greedy_alone
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.filterwarnings("ignore")

BASE = "base"
PROMPT, NEW = 6, 5


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return sf.build(tmp_path_factory.mktemp("hybrid"), seed=4, max_positions=64,
                    family="qwen3_5_moe_text", **QWEN35)  # fmt: skip


def test_requests_together_answer_what_hf_peft_give_each_alone(served, seed):
    adapters = sorted(served.dirs)[:2]
    argv = [str(served.root / "model"), "--served-model-name", BASE, "--moe-backend",
            "reference", "--decode-runner", "on", "--block-size", "4", "--max-model-len",
            "16", "--num-gpu-blocks-override", "7", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "8", "--enable-prefix-caching",
            "--lora-modules", *[f"{n}={served.dirs[n]}" for n in adapters]]  # fmt: skip
    server = sf.start(argv, served.root / "server.log")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                               timeout=120)  # fmt: skip
        rng = random.Random(seed)
        requests = [(m, [rng.randrange(1, 96) for _ in range(PROMPT)])
                    for m in (BASE, *adapters, BASE)]  # fmt: skip
        got: dict[int, str] = {}

        def send(i: int, model: str, ids: list[int]) -> None:
            try:
                out = client.completions.create(model=model, max_tokens=NEW, temperature=0,
                                                prompt=ids)  # fmt: skip
                got[i] = (out.choices[0].finish_reason, out.choices[0].text)
            except Exception as err:  # read on the test's thread
                got[i] = (repr(err), None)

        threads = [threading.Thread(target=send, args=(i, m, p))
                   for i, (m, p) in enumerate(requests)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert sorted(got) == list(range(len(requests))), got
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        preemptions = [s.value for fam in text_string_to_metric_families(metrics)
                       if fam.name == "vllm:num_preemptions" for s in fam.samples]  # fmt: skip
        assert preemptions and preemptions[0] > 0, preemptions  # rows recomputed
        # transformers loads Qwen3.5's own tokenizer class for this directory (the word
        # tokenizer's encode is lost, its decode kept): prompts go as token ids, the truth's
        # tokens are decoded as the server decodes them
        from transformers import AutoTokenizer

        server_tokenizer = AutoTokenizer.from_pretrained(served.root / "model")
        # one prompt twice in a row: the second reads its first block and the state snapshot
        # after it (nothing ran between them to take the block back)
        again = [rng.randrange(1, 96) for _ in range(PROMPT)]
        hits = _counter(server, "vllm:prefix_cache_hits")
        for i in (len(requests), len(requests) + 1):
            requests.append((adapters[0], again))
            send(i, adapters[0], again)
        assert _counter(server, "vllm:prefix_cache_hits") - hits == 4  # (6 - 1) // 4 * 4
        for i, (model, ids) in enumerate(requests):
            truth = served.truths.get(model, served.base)
            tokens = greedy_alone(truth, torch.tensor(ids), NEW)
            want = server_tokenizer.decode(tokens, skip_special_tokens=True)
            assert got[i] == ("length", want), (i, model)
    finally:
        assert server.stop() == 0, server.log.read_text()
    log = server.log.read_text()
    assert "prefix caching on" in log, log


def _counter(server, name: str) -> float:
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    (value,) = [s.value for fam in text_string_to_metric_families(metrics) if fam.name == name
                for s in fam.samples if s.name.endswith("_total")]  # fmt: skip
    return value
