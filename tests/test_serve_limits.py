"""What bounds a connection before the app reads it (moelora/serve/limits.py), and /health
once the engine thread has died: uvicorn on 127.0.0.1 in a thread with moelora's h11
protocol and body limit around a small app, talked to over raw sockets (a client that sends
half a request is what these guard against), and the served app over ASGI."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx2 as httpx
import pytest
import serve_fixtures as sf
import uvicorn

from moelora.serve.limits import BodyLimit, body_limit, timed_h11

HEAD_S, BODY_S, LIMIT = 0.5, 0.5, 1000


async def echo(scope, receive, send):
    """A tiny ASGI app: answers the body's length."""
    if scope["type"] != "http":
        return
    message = await receive()
    body = json.dumps({"bytes": len(message.get("body", b""))}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def url():
    port = sf.free_port()
    config = uvicorn.Config(BodyLimit(echo, LIMIT, BODY_S), host="127.0.0.1", port=port,
                            http=timed_h11(HEAD_S), log_level="warning", lifespan="off")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):  # bounded (10 s): until it listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", port
    server.should_exit = True
    thread.join(10)


def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server sends before it closes the connection (b"" if only closed); fails
    if it is still open after `seconds`."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        pytest.fail(f"the connection is still open after {seconds} s (received {got!r})")
    return got


HALF_HEADS = [
    # (id, what the client sends, then stops): a head that never completes
    ("nothing", b""),
    ("request-line-only", b"POST /x HTTP/1.1\r\n"),
    ("half-headers", b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Le"),
]


@pytest.mark.parametrize("case", HALF_HEADS, ids=[c[0] for c in HALF_HEADS])
def test_a_half_sent_request_head_is_closed_after_the_head_timeout(url, case):
    _, data = case
    with socket.create_connection(("127.0.0.1", url[1])) as sock:
        sock.sendall(data)
        start = time.monotonic()
        _closed_within(sock, 10 * HEAD_S)
        assert HEAD_S * 0.8 <= time.monotonic() - start < 5 * HEAD_S


def test_a_half_sent_body_is_answered_408(url):
    with socket.create_connection(("127.0.0.1", url[1])) as sock:
        sock.sendall(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n0123456789")
        got = _closed_within(sock, 10 * BODY_S)
    assert got.startswith(b"HTTP/1.1 408") and b'"code": 408' in got, got


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_past_the_limit_is_answered_413(url, chunked):
    big = b"x" * (LIMIT + 1)
    if chunked:  # no Content-Length: counted as the parts arrive
        got = httpx.post(url[0], content=iter([big[:600], big[600:]]), timeout=5)
    else:
        got = httpx.post(url[0], content=big, timeout=5)
    assert got.status_code == 413 and got.json()["error"]["code"] == 413
    assert str(LIMIT) in got.json()["error"]["message"]


def test_bodies_within_the_limit_and_kept_alive_connections_are_served(url):
    with httpx.Client(timeout=5) as client:  # one connection, several requests
        for size in (0, 10, LIMIT):
            got = client.post(url[0], content=b"y" * size)
            assert got.status_code == 200 and got.json() == {"bytes": size}
            time.sleep(HEAD_S / 5)


def test_the_limit_follows_max_model_len():
    assert body_limit(128) < body_limit(4096) and body_limit(4096) > 64 * 4096


class _DeadScheduler:
    alive = False
    fault = RuntimeError("injected scheduler fault")

    class engine:  # what build_app reads: the engine's max_len
        max_len = 128


def test_health_answers_503_once_the_engine_thread_has_died():
    from moelora.serve.app import build_app
    from moelora.serve.context import ServeContext

    app = build_app(ServeContext(None, _DeadScheduler(), None, "base"))

    async def get():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get("/health")

    got = asyncio.run(get())
    assert got.status_code == 503 and got.json()["status"] == "dead"
    assert "injected scheduler fault" in got.json()["error"]
