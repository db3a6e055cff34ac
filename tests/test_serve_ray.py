"""moelora behind Ray Serve (moelora.serve.ray): a real local Ray cluster on the CPU, two
engine replicas of the tiny model, four PEFT-written adapters and max_num_models_per_replica
2 (--max-loras 2), talked to with the official `openai` client through Ray's HTTP proxy on
127.0.0.1. Requests are routed by adapter (Ray Serve's model multiplexing, the multiplexed
model id set by the ingress from the body's `model`): each adapter is loaded once, on the
replica that serves every request of it; every row equals the same request against one
in-process moelora engine (fp32, greedy: equal tokens), errors included. One
`moelora serve --ray-replicas 2` process (its own local Ray cluster) for the module, stopped
by SIGTERM at its end (exit 0)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import httpx2
import openai
import pytest
import serve_fixtures as sf
from prometheus_client.parser import text_string_to_metric_families

from moelora.cli import build_parser, main
from moelora.errors import ConfigError
from moelora.serve import launch
from moelora.serve.app import build_app

with warnings.catch_warnings():  # Ray's own notes at import (its pydantic models' Field extras)
    warnings.simplefilter("ignore", DeprecationWarning)
    from moelora.serve import ray as moelora_ray

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("one_torch_thread")]

KEY = "sk-ray"
BASE = "base"
ADAPTERS = ["fused-r8", "fused-r4-attn", "modules-r4", "fused-r2"]  # toy.demo_adapters
# Seconds after a replica starts loading an adapter by which Ray's routers know it holds it
# (the replica pushes its models every 0.1 s; the controller relays them at once): 15x.
ROUTING_SETTLE_S = 1.5
# Ray's router gives a replica 0.1 s (up to 1 s on retries) to report its queue before it
# tries another; a replica that misses it makes Ray route by load, not by adapter (the other
# replica then loads the adapter too). Two test processes share these 2 cores: 10x, so that
# what is checked is the routing by adapter, not this machine's load.
PATIENT_ROUTER = {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1",
                  "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "10"}  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_seed):
    return sf.build(tmp_path_factory.mktemp("ray-served"), seed=model_seed)


def serve_argv(served) -> list[str]:
    return ["serve", str(served.root / "model"), "--served-model-name", BASE, "--api-key", KEY,
            "--max-loras", "2", "--moe-backend", "reference",
            "--lora-modules", *[f"{n}={served.dirs[n]}" for n in ADAPTERS]]  # fmt: skip


def serve_args(served):
    return build_parser().parse_args(serve_argv(served))


@pytest.fixture(scope="module")
def cluster(served):
    """`moelora serve --ray-replicas 2` in a child process: a local Ray cluster of this
    machine's CPUs, 2 engine replicas (one CPU each), the ingress (no CPU), Ray's proxy on a
    free port; its base URL. SIGTERM at the end: Ray Serve shut down, exit 0."""
    argv = [*serve_argv(served)[1:], "--ray-replicas", "2"]
    with pytest.MonkeyPatch.context() as env:  # the child's environment (sf.start reads it)
        for name, value in PATIENT_ROUTER.items():
            env.setenv(name, value)
        server = sf.start(argv, served.root / "ray.log", ready_s=180)
    yield server.url
    assert server.stop(timeout=60) == 0, server.log.read_text()[-4000:]


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(served):
    """One moelora engine in this process (every adapter loaded at start), its app called
    through httpx's ASGI transport: the answers Ray's rows must equal."""
    ctx = launch.start(serve_args(served))
    yield build_app(ctx)
    ctx.scheduler.stop(0.0)
    ctx.scheduler.engine.close()


def on_engine(app, calls):
    """Each call(client) against the in-process engine, concurrently; their results."""

    async def run():
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t")
        async with openai.AsyncOpenAI(base_url="http://t/v1", api_key=KEY, http_client=http,
                                      max_retries=0) as one:  # fmt: skip
            return await asyncio.gather(*(call(one) for call in calls), return_exceptions=True)

    return asyncio.run(run())


def words(rng: random.Random, count: int) -> str:
    return " ".join(f"w{rng.randrange(1, 96)}" for _ in range(count))


def row(out) -> tuple:
    """What a completion's client reads, but its id and time."""
    choice = out.choices[0]
    return choice.text, choice.finish_reason, out.usage.prompt_tokens, out.usage.completion_tokens


def test_requests_land_on_the_replica_holding_their_adapter_and_equal_one_engine(
    client, cluster, engine, seed
):
    rng = random.Random(seed)
    first = rng.sample(ADAPTERS, len(ADAPTERS))  # one request each, one at a time
    mixed = [a for a in ADAPTERS for _ in range(3)] + [BASE] * 2  # then all at once
    rng.shuffle(mixed)
    requests = [(a, words(rng, rng.randrange(1, 9)), rng.randrange(1, 6)) for a in first + mixed]

    def ask(request):
        model, prompt, n = request
        raw = client.completions.with_raw_response.create(
            model=model, prompt=prompt, max_tokens=n, temperature=0
        )
        loads = raw.headers.get("x-moelora-adapter-loads")
        return row(raw.parse()), raw.headers["x-moelora-replica"], loads

    answers = []
    for request in requests[: len(first)]:
        answers.append(ask(request))
        time.sleep(ROUTING_SETTLE_S)  # Ray's routers learn where the adapter now is
    with ThreadPoolExecutor(8) as pool:
        answers += list(pool.map(ask, requests[len(first) :]))

    refs = on_engine(engine, [
        lambda one, m=m, p=p, n=n: one.completions.create(model=m, prompt=p, max_tokens=n,
                                                          temperature=0)
        for m, p, n in requests
    ])  # fmt: skip
    for request, (out, _, _), ref in zip(requests, answers, refs):
        assert out == row(ref), (request, out, row(ref))

    served_by, loads = defaultdict(set), defaultdict(dict)
    for (model, _, _), (_, replica, count) in zip(requests, answers):
        served_by[model].add(replica)
        if model == BASE:
            assert count is None  # no adapter: no multiplexed model id, no load
        else:
            loads[model][replica] = max(int(count), loads[model].get(replica, 0))
    assert len(set().union(*served_by.values())) == 2, served_by  # both replicas served
    for adapter in ADAPTERS:
        # routed by adapter: every request of it on the one replica that loaded it, once
        assert len(served_by[adapter]) == 1, (adapter, served_by)
        assert loads[adapter] == dict.fromkeys(served_by[adapter], 1), (adapter, loads)
    for replica in set().union(*served_by.values()):
        held = [a for a in ADAPTERS if replica in served_by[a]]
        assert len(held) <= 2, (replica, held)  # max_num_models_per_replica (--max-loras)
    # whichever replica answers /metrics: two adapters read by Ray's loader, timed
    text = httpx2.get(cluster + "/metrics", timeout=30).text
    (family,) = [f for f in text_string_to_metric_families(text)
                 if f.name == "moelora_lora_adapter_load_seconds"]  # fmt: skip
    counts = {s.labels["source"]: s.value for s in family.samples if s.name.endswith("_count")}
    assert counts.get("multiplexed") == 2, counts


def test_a_stream_through_ray_equals_one_engine(client, engine, seed):
    rng = random.Random(seed)
    cases = [(m, words(rng, rng.randrange(1, 6)), rng.randrange(2, 7)) for m in (BASE, "fused-r2")]

    def chat(one, model, text, n):
        return one.chat.completions.create(model=model, max_tokens=n, temperature=0,
                                           messages=[{"role": "user", "content": text}],
                                           stream=True)  # fmt: skip

    async def text_of(one, model, text, n):
        parts = [c async for c in await chat(one, model, text, n)]
        return "".join(c.choices[0].delta.content or "" for c in parts), parts[-1].choices[0]

    refs = on_engine(engine, [lambda one, c=c: text_of(one, *c) for c in cases])
    for case, (ref_text, ref_last) in zip(cases, refs):
        parts = list(chat(client, *case))
        out = "".join(c.choices[0].delta.content or "" for c in parts)
        assert out == ref_text, (case, out, ref_text)
        assert parts[-1].choices[0].finish_reason == ref_last.finish_reason == "length"


def test_models_and_refusals_read_as_one_engine(client, cluster, engine):
    """The routes and errors clients meet are `moelora serve`'s: the same /v1/models, and
    the same status and message for an unknown model, a prompt past --max-model-len and a
    wrong key (every replica lists the deployment's adapters, not only those it holds)."""
    assert [m.id for m in client.models.list().data] == [BASE, *sorted(ADAPTERS)]
    calls = [
        lambda one: one.completions.create(model="no-such-adapter", prompt="w1", max_tokens=1),
        lambda one: one.completions.create(model="fused-r8", prompt="w1", max_tokens=10**6),
        lambda one: one.with_options(api_key="wrong").completions.create(
            model=BASE, prompt="w1", max_tokens=1),
    ]  # fmt: skip
    refs = on_engine(engine, [lambda one, c=c: _async(c, one) for c in calls])
    for call, ref in zip(calls, refs):
        with pytest.raises(openai.APIStatusError) as err:
            call(client)
        assert isinstance(ref, openai.APIStatusError), ref
        assert (err.value.status_code, err.value.message) == (ref.status_code, ref.message)
    assert [r.status_code for r in refs] == [404, 400, 401]
    health = httpx2.get(cluster + "/health", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok"}


async def _async(call, one):
    return await call(one)


# (id, steps on one replica's adapters, adapters loaded after, reads per adapter): what a
# request in flight does to Ray's eviction of its adapter
HOLD_CASES = [
    ("evict-idle", ["load a", "load b", "evict a"], ["b"], {"a": 1, "b": 1}),
    ("evict-in-flight-waits", ["load a", "enter a", "evict a"], ["a"], {"a": 1}),
    ("last-leave-unloads", ["load a", "enter a", "enter a", "evict a", "leave a", "leave a"],
     [], {"a": 1}),
    ("reload-while-pending", ["load a", "enter a", "evict a", "load a", "leave a"], ["a"],
     {"a": 1}),  # still in the engine: not read again, and not unloaded at the leave
    ("evicted-then-read-again", ["load a", "evict a", "load a"], ["a"], {"a": 2}),
]  # fmt: skip


@pytest.mark.parametrize("case", HOLD_CASES, ids=[c[0] for c in HOLD_CASES])
def test_an_adapter_leaves_its_replica_when_evicted_and_idle(case, served):
    """ReplicaAdapters on a real engine's handle (no Ray): Ray's eviction unloads the
    adapter (its slot freed) unless requests of it are in flight, then at the last leave."""
    _, steps, loaded, reads = case
    from moelora.serve.model_dir import ServeSettings, load

    handle, _ = load(ServeSettings(model=served.root / "model", max_loras=2,
                                   moe_backend="reference"))  # fmt: skip
    names = {"a": "fused-r8", "b": "fused-r2"}
    held = moelora_ray.ReplicaAdapters(handle, {names[k]: served.dirs[names[k]] for k in names})
    act = {"load": held.load, "evict": held.evicted, "enter": held.enter, "leave": held.leave}
    for step in steps:
        verb, key = step.split()
        act[verb](names[key])
    assert handle.adapters == sorted(names[k] for k in loaded)
    assert dict(held.loads) == {names[k]: n for k, n in reads.items()}
    keys = {handle.version(names[k]).key for k in loaded}
    manager = handle.registry.manager
    assert set(manager.loaded) <= keys  # an unloaded adapter holds no slot...
    assert set(manager.registered) == keys  # ...and no host copy


def test_without_ray_the_error_names_the_extra(tmp_path):
    """Importing moelora.serve.ray where Ray is missing raises the ConfigError naming
    `pip install 'moelora[ray]'` (ray hidden from the import system)."""
    code = ("import sys; sys.modules['ray'] = None\n"
            "try:\n    import moelora.serve.ray\nexcept Exception as err:\n"
            "    print(type(err).__name__, err)\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # fmt: skip
    assert done.stdout.startswith("ConfigError"), done.stdout + done.stderr
    assert "pip install 'moelora[ray]'" in done.stdout, done.stdout


def test_flags_that_load_behind_rays_back_are_refused(served, capsys):
    """--enable-runtime-lora and --lora-resolver-dir would load an adapter on one replica
    behind Ray's router: refused before Ray starts (the command line exits 2)."""
    port = str(sf.free_port())
    argv = ["serve", str(served.root / "model"), "--ray-replicas", "2",
            "--port", port, "--enable-runtime-lora"]  # fmt: skip
    assert main(argv) == 2
    assert "--enable-runtime-lora" in capsys.readouterr().err
    args = serve_args(served)
    args.lora_resolver_dir = str(served.root)
    with pytest.raises(ConfigError, match="--lora-resolver-dir"):
        moelora_ray.application(args, replicas=2, gpus_per_replica=0)


@pytest.mark.parametrize("when", ["while serve.run waits", "after it returned"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_at_any_point_of_the_start_shuts_ray_down_and_exits_0(
    monkeypatch, served, sig, when
):
    """Ray's proxy answers before `serve.run` returns (it waits for every replica): a
    signal then must stop the start, not reach ray.init's handlers (Ray's C++ one aborts
    3 s later: exit -6). Ray's calls faked; the signal sent to this process, once inside
    serve.run's wait, once after it returned (the test's handlers put back after): run
    returns 0 within seconds, Serve and Ray shut down."""
    calls, ready, done = [], threading.Event(), threading.Event()

    def blocking_run(app, **kw):
        calls.append("serve.run")
        if when == "while serve.run waits":
            os.kill(os.getpid(), sig)
            time.sleep(30)  # a replica still starting; the signal must end this wait
            calls.append("serve.run returned")

    def later():  # once run waits for the signal
        if ready.wait(30) and not done.wait(0.5):
            os.kill(os.getpid(), sig)

    kept = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(moelora_ray.ray, "init", lambda **kw: calls.append("ray.init"))
    monkeypatch.setattr(moelora_ray.ray, "shutdown", lambda: calls.append("ray.shutdown"))
    monkeypatch.setattr(moelora_ray.serve, "start", lambda **kw: calls.append("serve.start"))
    monkeypatch.setattr(moelora_ray.serve, "run", blocking_run)
    monkeypatch.setattr(moelora_ray.serve, "shutdown", lambda: calls.append("serve.shutdown"))
    monkeypatch.setattr(moelora_ray, "application", lambda args: "app")
    waits = moelora_ray._StopSignals.wait
    monkeypatch.setattr(moelora_ray._StopSignals, "wait",
                        lambda self: (ready.set(), waits(self)))  # fmt: skip
    args = serve_args(served)
    args.port, args.ray_replicas = sf.free_port(), 2
    signaller = threading.Thread(target=later, daemon=True)
    if when == "after it returned":
        signaller.start()
    started = time.monotonic()
    try:
        assert moelora_ray.run(args) == 0
    finally:
        done.set()
        for s, handler in kept.items():
            signal.signal(s, handler)
    assert time.monotonic() - started < 20, "the signal did not end serve.run's wait"
    assert calls == ["ray.init", "serve.start", "serve.run", "serve.shutdown", "ray.shutdown"]
