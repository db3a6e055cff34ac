"""`moelora serve --adapter-preemption` as a user meets it: a real server process with one
adapter slot and the official `openai` client. A long stream holds the slot; a request on
another adapter arrives, waits 3 s (the admission policy's max_wait), then the long stream
is suspended for it (vllm:num_preemptions_total counts it): the short request finishes
first, the long stream pauses and resumes, and both texts equal what HF + PEFT give each
prompt alone (fp32)."""

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

BASE, LONG, SHORT = "base", "fused-r8", "modules-r4"
LONG_N, SHORT_N = 100, 4


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_seed):
    return sf.build(tmp_path_factory.mktemp("preemption"), seed=model_seed, max_positions=128)


def preemptions(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return next(s.value for fam in text_string_to_metric_families(text)
                if fam.name == "vllm:num_preemptions" for s in fam.samples)  # fmt: skip


def test_a_held_slot_is_given_up_for_a_waiting_adapter_and_both_stay_exact(served, seed):
    argv = [str(served.root / "model"), "--served-model-name", BASE, "--max-loras", "1",
            "--max-num-seqs", "2", "--moe-backend", "reference", "--decode-runner", "on",
            "--adapter-preemption",
            "--lora-modules", *[f"{n}={served.dirs[n]}" for n in (LONG, SHORT)]]  # fmt: skip
    server = sf.start(argv, served.root / "server.log")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                               timeout=300)  # fmt: skip
        rng = random.Random(seed)
        prompts = {m: " ".join(f"w{rng.randrange(1, 96)}" for _ in range(3)) for m in (LONG, SHORT)}
        started, done, texts = threading.Event(), {}, {}

        def long_stream():
            text = ""
            stream = client.completions.create(model=LONG, prompt=prompts[LONG],
                                               max_tokens=LONG_N, temperature=0, stream=True)  # fmt: skip
            for chunk in stream:
                text += chunk.choices[0].text
                started.set()
            texts[LONG], done[LONG] = text, time.monotonic()

        thread = threading.Thread(target=long_stream)
        thread.start()
        assert started.wait(120), "the long stream never started"
        short = client.completions.create(model=SHORT, prompt=prompts[SHORT],
                                          max_tokens=SHORT_N, temperature=0)  # fmt: skip
        texts[SHORT], done[SHORT] = short.choices[0].text, time.monotonic()
        thread.join(300)
        assert not thread.is_alive(), "the long stream never ended"
        assert preemptions(server) >= 1, "the long stream was not suspended"
        assert done[SHORT] < done[LONG], "the short request waited for the long one"
        for model, n in ((LONG, LONG_N), (SHORT, SHORT_N)):
            ids = served.tokenizer(prompts[model])["input_ids"]
            assert texts[model] == sf.truth_text(served, model, ids, n), model
    finally:
        assert server.stop() == 0, server.log.read_text()
