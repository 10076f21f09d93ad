"""Connection hygiene and request limits of `kiln serve`'s HTTP stack (uvicorn under connections.py's
guard, the app's limits.BodyLimit), in-process on the fake engine over loopback: bodies too large
(413 from Content-Length or as they stream), bodies and headers too slow (408), headers too large
(431), slowloris connections shed oldest first, the connection limit's 503, CORS."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("uvicorn")
import httpx  # noqa: E402
import uvicorn  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from server_fake import FakeAsyncLLM  # noqa: E402

from kiln.runtime.server.connections import ConnectionGuard, ConnectionLimits  # noqa: E402
from kiln.runtime.server.launch import ServeOptions, guarded_config, serving_app  # noqa: E402

LIMIT = 64 * 1024
LIMITS = ConnectionLimits(max_connections=6, read_timeout=0.6, max_incomplete=2, grace=0.2,
                          max_header_bytes=32 * 1024, linger=1.0)


class LiveServer:
    def __init__(self, limits: ConnectionLimits = LIMITS, **options):
        self.fake = FakeAsyncLLM(token_delay=0.05)
        self.refused: list[int] = []
        opts = ServeOptions(port=0, log_level="warning", max_request_bytes=LIMIT, read_timeout=limits.read_timeout,
                            **options)
        self.app = serving_app(lambda: self.fake, opts)
        self.guard = ConnectionGuard(limits, on_refuse=self.refused.append)
        self.server = uvicorn.Server(guarded_config(self.app, opts, self.guard))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)


@pytest.fixture(scope="module")
def live():
    server = LiveServer()
    yield server
    server.stop()


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """Status, headers and body of one answer; the body until the peer closes or Content-Length is met."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed without an answer: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def post_head(length: int | None = None, path: str = "/v1/completions") -> bytes:
    framing = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    return f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{framing}\r\n\r\n".encode()


def test_a_body_declared_too_large_is_413_before_it_is_sent(live):
    with live.connect() as sock:
        start = time.perf_counter()
        sock.sendall(post_head(50_000_000))
        status, headers, body = read_response(sock)
        assert time.perf_counter() - start < 0.5
        assert status == 413 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "request_too_large" and str(LIMIT) in body.decode()
        assert closed_by_server(sock)


def test_a_streamed_body_is_413_once_it_passes_the_limit_and_the_client_reads_the_answer(live):
    chunk = b"x" * 8192

    def chunks():
        for _ in range(4 * LIMIT // len(chunk)):
            yield chunk

    r = httpx.post(live.url + "/v1/completions", content=chunks(), timeout=10)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    big = httpx.post(live.url + "/v1/completions", content=b"x" * (8 * LIMIT), timeout=10)  # sent whole, read after
    assert big.status_code == 413
    assert httpx.post(live.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_body_that_stops_arriving_is_408(live):
    with live.connect() as sock:
        sock.sendall(post_head(100) + b'{"prompt": ')
        start = time.perf_counter()
        status, _, body = read_response(sock)
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
        assert LIMITS.read_timeout * 0.8 < time.perf_counter() - start < LIMITS.read_timeout + 2
        assert closed_by_server(sock)


def test_headers_that_stop_arriving_are_408(live):
    with live.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        status, _, body = read_response(sock)
        assert status == 408 and "did not arrive within 0.6 s" in json.loads(body)["error"]["message"]
        assert closed_by_server(sock)
    with live.connect() as sock:  # a connection that sends nothing at all
        assert read_response(sock)[0] == 408


def test_headers_too_large_are_431(live):
    with live.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-filler: " + b"a" * (LIMITS.max_header_bytes + 10))
        assert read_response(sock)[0] == 431


def test_slow_arrivals_past_the_bound_are_shed_oldest_first_while_normal_requests_pass(live):
    slow = []
    for _ in range(LIMITS.max_incomplete + 2):
        sock = live.connect()
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")  # and never the blank line
        slow.append(sock)
        time.sleep(LIMITS.grace * 1.5)
    try:
        assert [read_response(s)[0] for s in slow[:2]] == [408, 408]  # the two oldest, shed as newer ones came
        for _ in range(5):
            assert httpx.get(live.url + "/health", timeout=5).status_code == 200
    finally:
        for sock in slow:
            sock.close()


def test_one_connection_past_the_limit_is_503_in_openai_shape(live):
    body = json.dumps({"prompt": "x", "max_tokens": 40, "stream": True}).encode()
    held = []
    for _ in range(LIMITS.max_connections):  # streams still running: open connections, none arriving
        sock = live.connect()
        sock.sendall(post_head(len(body)) + body)
        assert sock.recv(12).startswith(b"HTTP/1.1 200")
        held.append(sock)
    try:
        with live.connect() as extra:
            status, headers, answer = read_response(extra)
            assert status == 503 and headers["retry-after"] == "1"
            assert json.loads(answer)["error"]["code"] == "too_many_connections"
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while len(live.guard.open) >= LIMITS.max_connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(live.url + "/health", timeout=5).status_code == 200
    assert 503 in live.refused and 408 in live.refused


def test_allowed_origins_answer_cors_preflights_without_the_api_key():
    options = ServeOptions(api_key="k", allowed_origins=("https://chat.example",))
    with TestClient(serving_app(FakeAsyncLLM, options)) as client:
        ask = {"Origin": "https://chat.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization,content-type"}
        r = client.options("/v1/chat/completions", headers=ask)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://chat.example"
        r = client.options("/v1/chat/completions", headers={**ask, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers
        r = client.get("/v1/models", headers={"Origin": "https://chat.example", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://chat.example"
    with TestClient(serving_app(FakeAsyncLLM, ServeOptions())) as client:  # none allowed: same-origin only
        r = client.get("/v1/models", headers={"Origin": "https://chat.example"})
        assert "access-control-allow-origin" not in r.headers
