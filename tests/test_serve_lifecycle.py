"""`moelora serve` faults a user meets: runtime loading while the flag is off (403), a
client that leaves mid-stream (its row is freed at the next step), SIGTERM (running rows
finish, new connections are refused, exit code 0). One real server process, stopped by the
last test."""

from __future__ import annotations

import threading
import time

import httpx2 as httpx
import openai
import pytest
import serve_fixtures as sf

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def plain(tmp_path_factory, model_seed):
    """No --api-key, no --enable-runtime-lora; one adapter; 4096 positions (a long request)."""
    served = sf.build(tmp_path_factory.mktemp("plain"), seed=model_seed,
                      max_positions=4096)  # fmt: skip
    argv = [str(served.root / "model"), "--served-model-name", "base", "--moe-backend",
            "reference", "--max-num-seqs", "4", "--lora-modules",
            f"fused-r8={served.dirs['fused-r8']}"]  # fmt: skip
    server = sf.start(argv, served.root / "server.log")
    server.served = served
    yield server
    server.stop()  # the SIGTERM test stopped it already; a failure before that lands here


def metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("route", ["load_lora_adapter", "unload_lora_adapter"])
def test_runtime_loading_off_is_refused_403(plain, route):
    body = {"lora_name": "fused-r8", "lora_path": str(plain.served.dirs["fused-r8"])}
    got = httpx.post(f"{plain.url}/v1/{route}", json=body)
    assert got.status_code == 403, got.text
    assert "--enable-runtime-lora" in got.json()["error"]["message"]
    client = openai.OpenAI(base_url=plain.url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["base", "fused-r8"]  # unchanged


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_leaving_frees_its_row(plain, stream):
    cancelled = 'moelora_requests_total{finish_reason="cancelled"}'
    before = metric(plain, cancelled)
    body = {"model": "fused-r8", "prompt": "w4 w5", "max_tokens": 4000, "stream": stream}
    if stream:
        with httpx.stream("POST", plain.url + "/v1/completions", json=body, timeout=60) as got:
            lines = got.iter_lines()
            assert next(lines).startswith("data: ")  # the first token came: the row runs
    else:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s
            httpx.post(plain.url + "/v1/completions", json=body, timeout=1.0)
    # 4000 tokens take far longer than this wait: only the cancellation frees the row
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and metric(plain, cancelled) < before + 1:
        time.sleep(0.1)
    assert metric(plain, cancelled) == before + 1
    assert metric(plain, "moelora_rows_running") == 0


def test_sigterm_finishes_running_rows_and_exits_0(plain):
    client = openai.OpenAI(base_url=plain.url + "/v1", api_key="none", max_retries=0, timeout=60)
    # the row's whole text, from the same greedy request run alone first (a random model may
    # sample special tokens, which decode to nothing: counting words would not tell)
    whole = client.completions.create(model="fused-r8", prompt="w7 w8", max_tokens=6,
                                      temperature=0).choices[0].text  # fmt: skip
    parts, started = [], threading.Event()

    def stream():
        for chunk in client.completions.create(model="fused-r8", prompt="w7 w8", max_tokens=6,
                                               temperature=0, stream=True):  # fmt: skip
            parts.append(chunk.choices[0])
            started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    plain.proc.send_signal(__import__("signal").SIGTERM)
    reader.join(60)
    assert plain.stop() == 0, plain.log.read_text()
    assert parts[-1].finish_reason == "length" and "".join(p.text for p in parts) == whole
    with pytest.raises(httpx.TransportError):
        httpx.get(plain.url + "/health", timeout=2)
