"""The engine keeps each request's adapter version while another thread replaces, loads and
unloads adapters, on transformers' forward and on the runner (its prefill and decode): a
row added while one version of 'a' was current equals HF + PEFT alone with that version;
every finished row equals HF + PEFT alone with one version of its adapter (never a
mixture), base and attention-LoRA rows equal theirs, no step raises, and at the end nothing
is held (no slot lease, no version reference)."""

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
# the runner's kernels run in Triton's interpreter here (seconds a step, one program at a
# time): shorter rows over a longer window, so rows start under several versions
RUNNER_NEW, RUNNER_SECONDS = 2, 20.0
# past the window, rows keep being added until enough happened (ENOUGH_ROWS rows, 3 swaps),
# up to this many seconds: a machine busy with other work still tests something
ENOUGH_ROWS, MAX_SECONDS = 12, 120.0
# adapter name in the requests -> the directories it may hold while the swapper runs
VERSIONS = {"a": ("fused-r8", "fused-r2"), "attn": ("fused-r4-attn",), None: (None,)}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build_family("qwen3_moe", tmp_path_factory.mktemp("qwen"), seed=5)


@pytest.mark.parametrize("runner", [False, True], ids=["model-forward", "runner"])
def test_swaps_while_the_engine_runs(qwen, seed, runner):
    # a slot for every version 6 rows can hold at once, beside 'attn' and 'spare': the swaps
    # never wait for a slot (slot pressure is tests/test_slots_serving.py's)
    handle = attach(qwen.fresh(), num_slots=8, max_rank=16, moe_backend="reference")
    handle.load_adapter(qwen.dirs["fused-r8"], name="a")
    handle.load_adapter(qwen.dirs["fused-r4-attn"], name="attn")
    loaded = {handle.version("a").key: "fused-r8"}  # version key of 'a' -> its directory
    rng = random.Random(seed)
    pool = [tuple(rng.randrange(1, 96) for _ in range(rng.randint(3, 8))) for _ in range(4)]
    new = RUNNER_NEW if runner else NEW
    truth = {
        (p, d): greedy_alone(qwen.truth(d), torch.tensor(p), new)
        for p in pool
        for ds in VERSIONS.values()
        for d in ds
    }
    stop, errors, swaps = threading.Event(), [], [0]

    def swapper():
        try:
            for i in itertools.count(1):
                if stop.is_set():
                    return
                directory = VERSIONS["a"][i % 2]
                handle.load_adapter(qwen.dirs[directory], name="a")
                loaded[handle.version("a").key] = directory  # only this thread loads 'a'
                handle.load_adapter(qwen.dirs["modules-r4"], name="spare")
                handle.unload_adapter("spare")
                swaps[0] += 1
                time.sleep(0.3 if runner else 0.02)  # the interpreter needs the cores
        except Exception as exc:  # reported by the main thread
            errors.append(exc)

    def current() -> str | None:
        return loaded.get(handle.version("a").key)

    engine = Engine(handle, max_rows=6, max_len=24, enforce_eager=True, runner=runner)
    thread = threading.Thread(target=swapper)
    thread.start()
    asked, done, ids, last = {}, {}, itertools.count(), None
    start = time.monotonic()
    deadline = start + (RUNNER_SECONDS if runner else SECONDS)

    def adding() -> bool:  # the window, then until enough happened (bounded)
        now = time.monotonic()
        enough = len(done) >= ENOUGH_ROWS and swaps[0] >= 3
        return now < deadline or (not enough and now < start + MAX_SECONDS)

    try:
        while adding() or engine.has_work:
            while adding() and engine.running < engine.max_rows:
                rid, name, prompt = f"r{next(ids)}", rng.choice(list(VERSIONS)), rng.choice(pool)
                version = None
                if name == "a":  # alternate the versions rows start with (bounded wait)
                    wait = time.monotonic() + 5.0  # a swap takes longer on a loaded machine
                    while current() == last and time.monotonic() < wait:
                        time.sleep(0.01)
                    before = current()
                    engine.add(Request(rid, prompt, name, Sampling(max_new_tokens=new)))
                    version = before if current() == before else None  # None: swapped meanwhile
                    last = version or last
                else:
                    engine.add(Request(rid, prompt, name, Sampling(max_new_tokens=new)))
                asked[rid] = (name, prompt, version)
            for event in engine.step():
                done.setdefault(event.request_id, []).append(event.token_id)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not errors, errors
    assert sorted(done) == sorted(asked)
    served = set()
    for rid, tokens in done.items():
        name, prompt, version = asked[rid]
        if version is not None:  # the version it was added under: exactly its output
            assert tokens == truth[(prompt, version)], f"{rid} ({name} as {version}): {tokens}"
            served.add(version)
        else:
            matches = [d for d in VERSIONS[name] if truth[(prompt, d)] == tokens]
            assert matches, f"{rid} ({name}): {tokens} is no version's output"
    assert swaps[0] >= 3 and len(done) >= ENOUGH_ROWS, "too little happened to test anything"
    assert {"fused-r8", "fused-r2"} <= served, ("rows under both versions of 'a'", served)
    engine.close()
    assert not handle.registry.manager.leased(), "a slot is still leased"
