"""The engine keeps each request's adapter version while another thread replaces, loads and
unloads adapters: every finished row equals HF + PEFT alone with one version of its adapter
(never a mixture), base and attention-LoRA rows equal theirs, no step raises, and at the end
nothing is held (no slot lease, no version reference)."""

from __future__ import annotations

import itertools
import random
import threading
import time

import pytest
import torch
from engine_helpers import greedy_alone
from hf_models import build_family

from moelora.engine import Engine, Request, Sampling
from moelora.hf import attach

pytestmark = pytest.mark.filterwarnings("ignore")
NEW, SECONDS = 4, 4.0
# adapter name in the requests -> the directories it may hold while the swapper runs
VERSIONS = {"a": ("fused-r8", "fused-r2"), "attn": ("fused-r4-attn",), None: (None,)}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build_family("qwen3_moe", tmp_path_factory.mktemp("qwen"), seed=5)


def test_swaps_while_the_engine_runs(qwen, seed):
    handle = attach(qwen.fresh(), num_slots=4, max_rank=16, moe_backend="reference")
    handle.load_adapter(qwen.dirs["fused-r8"], name="a")
    handle.load_adapter(qwen.dirs["fused-r4-attn"], name="attn")
    rng = random.Random(seed)
    pool = [tuple(rng.randrange(1, 96) for _ in range(rng.randint(3, 8))) for _ in range(4)]
    truth = {
        (p, d): greedy_alone(qwen.truth(d), torch.tensor(p), NEW)
        for p in pool
        for ds in VERSIONS.values()
        for d in ds
    }
    stop, errors, swaps = threading.Event(), [], itertools.count()

    def swapper():
        try:
            for i in itertools.count():
                if stop.is_set():
                    return
                handle.load_adapter(qwen.dirs[VERSIONS["a"][i % 2]], name="a")
                handle.load_adapter(qwen.dirs["modules-r4"], name="spare")
                handle.unload_adapter("spare")
                next(swaps)
                time.sleep(0.02)
        except Exception as exc:  # reported by the main thread
            errors.append(exc)

    engine = Engine(handle, max_rows=6, max_len=24, enforce_eager=True)
    thread = threading.Thread(target=swapper)
    thread.start()
    asked, done, ids = {}, {}, itertools.count()
    deadline = time.monotonic() + SECONDS
    try:
        while time.monotonic() < deadline or engine.has_work:
            while time.monotonic() < deadline and engine.running < engine.max_rows:
                rid, name, prompt = f"r{next(ids)}", rng.choice(list(VERSIONS)), rng.choice(pool)
                asked[rid] = (name, prompt)
                engine.add(Request(rid, prompt, name, Sampling(max_new_tokens=NEW)))
            for event in engine.step():
                done.setdefault(event.request_id, []).append(event.token_id)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not errors, errors
    assert sorted(done) == sorted(asked)
    seen = set()
    for rid, tokens in done.items():
        name, prompt = asked[rid]
        matches = [d for d in VERSIONS[name] if truth[(prompt, d)] == tokens]
        assert matches, f"{rid} ({name}): {tokens} is no version's output"
        seen.add(matches[0])
    assert next(swaps) >= 3 and len(done) >= 12, "too little happened to test anything"
    assert {"fused-r8", "fused-r2"} <= seen, "both versions of 'a' must have served rows"
    engine.close()
    assert not handle.registry.manager.leased(), "a slot is still leased"
