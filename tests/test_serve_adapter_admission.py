"""Adapter-aware admission through a real `moelora serve` process and the official `openai`
client: 8 adapter names over 2 slots and 3 rows, streamed concurrently with a skewed
popularity (most requests on one name, the others rare). Every request completes, and each
greedy answer equals HF + PEFT generating that prompt alone with that adapter (fp32), so
admitting by adapter, copying adapters ahead and swapping slots changed no row's tokens."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest
import serve_fixtures as sf

pytestmark = pytest.mark.filterwarnings("ignore")

BASE = "base"
DIRS = ["fused-r8", "fused-r4-attn", "modules-r4", "fused-r2"]
NAMES = {f"{d}-{copy}": d for d in DIRS for copy in ("a", "b")}  # name -> adapter dir


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_seed):
    return sf.build(tmp_path_factory.mktemp("admission"), seed=model_seed)


@pytest.fixture(scope="module")
def server(served):
    argv = [str(served.root / "model"), "--served-model-name", BASE, "--max-loras", "2",
            "--max-num-seqs", "3", "--moe-backend", "reference",
            "--lora-modules", *[f"{n}={served.dirs[d]}" for n, d in NAMES.items()]]  # fmt: skip
    server = sf.start(argv, served.root / "server.log")
    yield server
    assert server.stop() == 0, server.log.read_text()


def slot_loads(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("moelora_adapter_slot_loads_total"))
    return float(line.split()[-1])


def test_skewed_streams_over_more_names_than_slots_equal_each_alone(served, server, seed):
    rng = random.Random(seed)
    hot = rng.choice(list(NAMES))
    rare = [n for n in NAMES if n != hot] + [BASE]
    jobs = [(hot if i % 2 else rare[i // 2 % len(rare)],
             " ".join(f"w{rng.randrange(1, 96)}" for _ in range(rng.randrange(1, 6))),
             rng.randrange(1, 5)) for i in range(24)]  # fmt: skip
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=120)  # fmt: skip
    before = slot_loads(server)

    def ask(job) -> tuple[str, str | None]:
        name, prompt, n = job
        stream = client.completions.create(model=name, prompt=prompt, max_tokens=n,
                                           temperature=0, stream=True)  # fmt: skip
        text, reason = "", None
        for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(ask, jobs))
    for (name, prompt, n), (text, reason) in zip(jobs, answers):
        ids = served.tokenizer(prompt)["input_ids"]
        ref = sf.truth_text(served, NAMES.get(name), ids, n)
        assert (text, reason) == (ref, "length"), (name, prompt)
    assert slot_loads(server) - before >= 2  # 8 names over 2 slots: adapters were swapped
