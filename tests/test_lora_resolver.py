"""`moelora serve --lora-resolver-dir DIR`: a request naming an unknown adapter loads
DIR/<name>. The name is confined to DIR (case table of hostile names, on fresh directories),
the adapter must be for the served model (vLLM's base-model check), the loader's refusals
hold (a corrupt file is a 400, nothing loaded), at most MAX_CONCURRENT_LOADS loads run at
once and concurrent first requests for one name load it once (counted in the server's
metrics); unload frees the slot and the host copy. A real server on 127.0.0.1, the `openai`
client, greedy answers equal to HF + PEFT with the adapter alone."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import serve_fixtures as sf
from prometheus_client.parser import text_string_to_metric_families

from moelora.errors import ConfigError
from moelora.serve.context import ServeError
from moelora.serve.launch import resolver_root_of
from moelora.serve.resolver import MAX_CONCURRENT_LOADS, LoraResolver, check_base, confined

pytestmark = pytest.mark.filterwarnings("ignore")

BASE = "base"


def adapter_dir(path: Path, base: str | None = BASE) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "base_model_name_or_path": base}))  # fmt: skip
    return path


# ---- the name confined to DIR (no server) --------------------------------------------------

# (id, the name a request sends given a fresh tree, resolves?): which edge it covers. The
# tree: DIR/<good>/ an adapter, DIR/org/<good>/ a nested one, OUT/<good>/ an adapter beside
# DIR, DIR/out-link -> OUT/<good>, DIR/in-link -> DIR/<good>, DIR/file a plain file.
NAMES = [
    ("plain", lambda g, out: g, True),  # DIR/<name>
    ("nested", lambda g, out: f"org/{g}", True),  # a sub-directory, as vLLM allows
    ("link-inside", lambda g, out: "in-link", True),  # a link whose target stays in DIR
    ("parent", lambda g, out: f"../{out.name}/{g}", False),  # `..` to a real adapter
    ("parent-mid", lambda g, out: f"org/../../{out.name}/{g}", False),  # `..` after a part
    ("absolute", lambda g, out: str(out / g), False),  # an absolute path to a real adapter
    ("link-out", lambda g, out: "out-link", False),  # a link in DIR pointing out of it
    ("dot", lambda g, out: ".", False),  # DIR itself
    ("empty-part", lambda g, out: f"org//{g}", False),  # `//`
    ("trailing-slash", lambda g, out: f"{g}/", False),  # an empty last part
    ("backslash", lambda g, out: f"..\\{g}", False),  # a Windows separator
    ("nul", lambda g, out: f"{g}\x00", False),  # NUL
    ("too-long", lambda g, out: g * 300, False),  # past a file name's 255 bytes
    ("a-file", lambda g, out: "file", False),  # not a directory
    ("missing", lambda g, out: g + "-nope", False),  # nothing there
]


@pytest.mark.parametrize("case", NAMES, ids=[c[0] for c in NAMES])
def test_a_name_resolves_only_inside_the_directory(case, tmp_path, seed):
    _, name_of, resolves = case
    good = f"a{random.Random(seed).randrange(10**6)}"
    root, out = tmp_path / "dir", tmp_path / f"out{seed}"
    adapter_dir(root / good), adapter_dir(root / "org" / good), adapter_dir(out / good)
    (root / "out-link").symlink_to(out / good, target_is_directory=True)
    (root / "in-link").symlink_to(root / good, target_is_directory=True)
    (root / "file").write_text("{}")
    name = name_of(good, out)
    path = confined(root.resolve(), name)
    if resolves:
        assert path is not None and path.is_relative_to(root.resolve()), (name, path)
    else:
        assert path is None, (name, path)


def test_the_base_model_must_be_the_served_one(tmp_path):
    bases = frozenset({BASE, "/models/m"})
    check_base(adapter_dir(tmp_path / "ok", "/models/m"), "ok", bases)  # the path as given
    for base in ("other-model", None):
        with pytest.raises(ServeError) as err:
            check_base(adapter_dir(tmp_path / f"x{base}", base), "x", bases)
        assert err.value.status == 400 and repr(base) in str(err.value)


# (id, DIR relative to tmp, --allowed-local-lora-path or None, accepted): checked at start
ROOTS = [
    ("no-allowed-path", "dir", None, True),  # the resolver's own confinement only
    ("under-allowed", "allowed/dir", "allowed", True),  # DIR inside the runtime loads' root
    ("outside-allowed", "dir", "allowed", False),  # DIR beside it: refused, naming both
    ("missing", "nope", None, False),  # no such directory
]


@pytest.mark.parametrize("case", ROOTS, ids=[c[0] for c in ROOTS])
def test_the_resolver_directory_is_checked_before_the_model_loads(case, tmp_path):
    _, where, allowed, accepted = case
    for d in ("dir", "allowed/dir"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(lora_resolver_dir=str(tmp_path / where),
                              allowed_local_lora_path=allowed and str(tmp_path / allowed))  # fmt: skip
    if accepted:
        assert resolver_root_of(args) == (tmp_path / where).resolve()
        return
    with pytest.raises(ConfigError) as err:
        resolver_root_of(args)
    assert "--lora-resolver-dir" in str(err.value)


# ---- one load per name, a bounded number at once (no server) --------------------------------


class CountingHandle:
    """Records each load_adapter call and how many ran at once; `fail` names refused ones."""

    def __init__(self, delay_s: float, fail: frozenset[str] = frozenset()) -> None:
        self.delay_s, self.fail = delay_s, fail
        self.loaded: dict[str, Path] = {}
        self.calls: list[str] = []
        self.now = self.most = 0
        self._lock = threading.Lock()

    def version(self, name):
        return self.loaded.get(name)

    def load_adapter(self, path, name):
        with self._lock:
            self.calls.append(name)
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(self.delay_s)
        with self._lock:
            self.now -= 1
        if name in self.fail:
            raise OSError("truncated safetensors")
        self.loaded[name] = path


class Loads:
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def adapter_loaded(self, source: str, seconds: float) -> None:
        assert source == "resolver"
        self.seconds.append(seconds)


def run_resolves(root: Path, handle, names: list[str]) -> list[object]:
    async def main():
        resolver = LoraResolver(root, handle, frozenset({BASE}), Loads())
        return await asyncio.gather(*(resolver.resolve(n) for n in names), return_exceptions=True)

    return asyncio.run(main())


def test_concurrent_first_requests_for_one_name_load_it_once(tmp_path, seed):
    name = f"a{seed}"
    adapter_dir(tmp_path / name)
    handle = CountingHandle(delay_s=0.2)
    results = run_resolves(tmp_path, handle, [name] * 12)
    assert results == [None] * 12 and handle.calls == [name]


def test_at_most_max_concurrent_loads_run_at_once(tmp_path, seed):
    names = [f"a{seed}-{i}" for i in range(3 * MAX_CONCURRENT_LOADS)]
    for n in names:
        adapter_dir(tmp_path / n)
    handle = CountingHandle(delay_s=0.1)
    assert run_resolves(tmp_path, handle, names) == [None] * len(names)
    assert sorted(handle.calls) == sorted(names) and handle.most == MAX_CONCURRENT_LOADS


def test_a_failed_load_is_shared_by_its_waiters_and_tried_again_later(tmp_path, seed):
    name = f"a{seed}"
    adapter_dir(tmp_path / name)
    handle = CountingHandle(delay_s=0.1, fail=frozenset({name}))
    results = run_resolves(tmp_path, handle, [name] * 5)
    assert all(isinstance(r, ServeError) and r.status == 400 for r in results), results
    assert handle.calls == [name]  # one load, its refusal read by all five
    run_resolves(tmp_path, handle, [name])
    assert handle.calls == [name, name]  # no failure is remembered: the file may be fixed


# ---- a real server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_seed):
    return sf.build(tmp_path_factory.mktemp("resolver"), seed=model_seed)


@pytest.fixture(scope="module")
def tree(served):
    """DIR with every adapter of `served` under a fresh name (base set to BASE), one for
    another model, a corrupt one, and a link out to an adapter beside DIR."""
    root, tag = served.root / "resolve", random.randrange(10**6)
    names = {}
    for i, source in enumerate(served.dirs):
        names[source] = f"team{tag}/{source}-{i}"
        shutil.copytree(served.dirs[source], root / names[source])
        config = json.loads((root / names[source] / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = BASE
        (root / names[source] / "adapter_config.json").write_text(json.dumps(config))
    other = root / f"other{tag}"
    shutil.copytree(root / names["fused-r8"], other)
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path":
                                                                    "someone/else"}))  # fmt: skip
    corrupt = root / f"corrupt{tag}"
    shutil.copytree(root / names["fused-r8"], corrupt)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    outside = served.root / f"outside{tag}"
    shutil.copytree(root / names["fused-r4-attn"], outside)
    (root / "link-out").symlink_to(outside, target_is_directory=True)
    return dict(root=root, names=names, other=other.name, corrupt=corrupt.name, outside=outside)


@pytest.fixture(scope="module")
def server(served, tree):
    argv = [str(served.root / "model"), "--served-model-name", BASE, "--max-loras", "2",
            "--moe-backend", "reference", "--enable-runtime-lora",
            "--lora-resolver-dir", str(tree["root"])]  # fmt: skip
    server = sf.start(argv, served.root / "server.log")
    yield server
    assert server.stop() == 0, server.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def scrape(server) -> dict:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip


def resolver_loads(server) -> float:
    return scrape(server).get(
        ("moelora_lora_adapter_load_seconds_count", (("source", "resolver"),)), 0.0)  # fmt: skip


def models(client) -> list[str]:
    return [m.id for m in client.models.list().data]


def test_hostile_names_are_unknown_models_and_load_nothing(server, client, tree):
    before, names = resolver_loads(server), models(client)
    outside = tree["outside"]
    for name in ("../" + outside.name, str(outside), "link-out", f"{outside.name}/../..", "."):
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model=name, prompt="w1", max_tokens=1)
        assert "does not exist" in err.value.message, (name, err.value.message)
    assert resolver_loads(server) == before and models(client) == names


@pytest.mark.parametrize("which,words", [("corrupt", "truncated or corrupt"),
                                         ("other", "someone/else")],
                         ids=["corrupt-weights", "other-base-model"])  # fmt: skip
def test_an_adapter_the_loader_refuses_is_a_400_and_nothing_changes(which, words, server,
                                                                    client, tree):  # fmt: skip
    before, names = resolver_loads(server), models(client)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=tree[which], prompt="w1", max_tokens=1)
    assert words in err.value.message and str(tree["root"]) not in err.value.message
    assert resolver_loads(server) == before and models(client) == names


def test_concurrent_first_requests_load_the_adapter_once(served, server, client, tree, seed):
    source = random.Random(seed).choice(sorted(served.dirs))
    name = tree["names"][source]
    rng = random.Random(seed)
    prompt = " ".join(f"w{rng.randrange(1, 96)}" for _ in range(4))
    before = resolver_loads(server)
    with ThreadPoolExecutor(8) as pool:
        texts = list(
            pool.map(
                lambda _: (
                    client.completions.create(
                        model=name, prompt=prompt, max_tokens=3, temperature=0
                    )
                    .choices[0]
                    .text
                ),
                range(8),
            )
        )
    ids = served.tokenizer(prompt)["input_ids"]
    assert texts == [sf.truth_text(served, source, ids, 3)] * 8  # HF + PEFT with it alone
    assert resolver_loads(server) == before + 1 and name in models(client)


def test_unload_frees_the_slot_and_the_host_copy(served, server, client, tree):
    name = tree["names"]["modules-r4"]
    client.completions.create(model=name, prompt="w3 w4", max_tokens=1)
    loaded = scrape(server)
    assert any(k[0] == "moelora_lora_slot_info" and ("adapter_name", name) in k[1] for k in loaded)
    reply = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": name})
    assert reply.status_code == 200, reply.text
    after = scrape(server)
    assert not any(("adapter_name", name) in k[1] for k in after
                   if k[0] in ("moelora_lora_slot_info", "moelora_lora_adapter_loaded"))  # fmt: skip
    # the slot manager forgot its one version: no parsed copy of it is held any more
    registered = ("moelora_lora_registered_adapters", ())
    assert after[registered] == loaded[registered] - 1
    assert name not in models(client)
    before = resolver_loads(server)
    client.completions.create(model=name, prompt="w3 w4", max_tokens=1)  # resolved again
    assert resolver_loads(server) == before + 1
