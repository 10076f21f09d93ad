"""`kiln serve` on the tiny engine under hostile traffic, over loopback, bounded in counts and time:
while a steady trickle of normal completions runs, other clients send 50 MB bodies and over-limit
chunked ones, slowloris headers, streams they never read, streams they drop at once, invalid UTF-8 and
lone surrogates, prompts 100x the context, and a burst beyond --max-queue. The trickle's p99 latency
stays within 2x its own p99 measured alone just before (with a floor: a few ms of scheduling noise on a
loaded two-core machine is no regression; further rounds, baseline and all, only while they miss, as
another process's hiccup only ever adds time), none of its requests fails, resident memory stays within
1.2x idle plus the KV pool, and every KV block is free afterwards. Then TLS with the official client."""

from __future__ import annotations

import datetime
import ipaddress
import json
import multiprocessing
import re
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from server_process import Server  # noqa: E402

MAX_MODEL_LEN, MAX_QUEUE, MAX_NUM_SEQS = 256, 8, 16
# A dense trickle (~150 requests during the mix), so its p99 is not simply its single worst request
TRICKLE_INTERVAL_S, BASELINE_REQUESTS = 0.02, 150
P99_FLOOR_S = 0.1  # the baseline p99 counts as at least this: on a two-core host that other jobs load, a request
# that waits for a core behind them takes ~0.05-0.2 s, while what this guards against (a 50 MB body parsed, a huge
# prompt tokenized or a template rendered on the event loop, the GIL held through a long tokenization, work
# queued behind the hostile requests' on the worker pool) stalls every request for 0.2 s to seconds
ROUNDS = 3  # a further round, baseline and all, only while they miss: another process's hiccup only ever adds time
NORMAL = {"prompt": "Hello there, how are you", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    srv = Server(tiny_engine, folder / "server.log", "--max-model-len", str(MAX_MODEL_LEN), "--max-queue",
                 str(MAX_QUEUE), "--max-num-seqs", str(MAX_NUM_SEQS), "--num-threads", "1", "--max-connections", "96",
                 "--read-timeout", "2")
    yield srv
    assert srv.stop() == 0


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class Trickle(threading.Thread):
    """Normal completions one after another on one keep-alive connection, every TRICKLE_INTERVAL_S; a pause
    lock lets the queue-bound burst be decided between two of them (a bound refuses anyone in that instant)."""

    def __init__(self, url: str, count: int | None = None):
        super().__init__(daemon=True)
        self.url, self.count = url, count
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.pause = threading.Lock()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stop.is_set() and (self.count is None or len(self.latencies) < self.count):
                with self.pause:
                    start = time.perf_counter()
                    try:
                        r = client.post("/v1/completions", json=NORMAL)
                        if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != 4:
                            self.failures.append(f"{r.status_code} {r.text[:200]}")
                    except httpx.HTTPError as e:
                        self.failures.append(repr(e))
                    self.latencies.append(time.perf_counter() - start)
                time.sleep(TRICKLE_INTERVAL_S)


class Endpoint(NamedTuple):
    """What a hostile client needs of the server (picklable, for the process they run in)."""
    url: str
    port: int


def raw(server: Server | Endpoint) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def post_bytes(body: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


# ---- the hostile clients: each returns what it saw, for the test to check ------------------------

def large_bodies(server: Endpoint) -> list[int]:
    """Two 50 MB bodies and a chunked one past the 1 MiB default limit, on raw sockets (as cheap to send as
    their bytes: the clients stand for other machines, so their own CPU must not be what the trickle feels)."""
    big = post_bytes(b'{"prompt": "' + b"x" * 50_000_000 + b'"}')
    chunk = b"10000\r\n" + b"y" * 65536 + b"\r\n"
    chunked = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"transfer-encoding: chunked\r\n\r\n" + chunk * 64 + b"0\r\n\r\n")  # 4 MiB
    statuses = []
    for request in (big, big, chunked):
        with raw(server) as sock:
            # the server answers early and drops the rest for a while, then closes: read the answer while sending,
            # as HTTP clients do, so a sender slower than that linger (a loaded host) still sees the 413
            head: list[bytes] = []
            reader = threading.Thread(target=lambda sock=sock, head=head: head.append(sock.recv(12)), daemon=True)
            reader.start()
            try:
                sock.sendall(request)
            except (BrokenPipeError, ConnectionResetError):
                pass
            reader.join(30)
            statuses.append(int(head[0].split()[1]) if head and head[0] else 0)
    return statuses


def slowloris(server: Endpoint, connections: int = 24) -> int:
    """Connections sending a header line a byte at a time; how many the server closed (shed or timed out)."""
    socks = [raw(server) for _ in range(connections)]
    closed = 0
    line = b"GET /health HTTP/1.1\r\nx-slow: " + b"z" * 100
    for i in range(len(line)):
        for sock in socks:
            try:
                sock.send(line[i:i + 1])
            except OSError:
                pass
        time.sleep(0.05)
        if i * 0.05 > 3.5:  # past --read-timeout: every one must be gone
            break
    for sock in socks:
        try:
            sock.settimeout(2)
            data = sock.recv(4096)
            closed += data.startswith(b"HTTP/1.1 408") or data == b""
        except TimeoutError:  # still open: not closed
            pass
        except OSError:  # reset
            closed += 1
        sock.close()
    return closed


def slow_readers(server: Endpoint, count: int = 6) -> list[socket.socket]:
    """Streams of 200 tokens that are never read (closed by the test at the end)."""
    body = json.dumps({"prompt": "never read", "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
    socks = []
    for _ in range(count):
        sock = raw(server)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(post_bytes(body))
        socks.append(sock)
    return socks


def abort_flood(server: Endpoint, count: int = 40) -> None:
    body = json.dumps({"prompt": "drop me", "max_tokens": 100, "ignore_eos": True, "stream": True}).encode()
    for i in range(count):
        with raw(server) as sock:
            sock.sendall(post_bytes(body))
            if i % 2:
                sock.recv(64)  # half leave after the first bytes, half at once


def bad_text(server: Endpoint) -> list[int]:
    bodies = [b'{"prompt": "bad \xff\xfe bytes"}', b'{"prompt": "lone \\ud800 surrogate"}',
              b'{"prompt": ["ok", "\\udfff"]}', b'\xc3\x28{"prompt": 1}']
    chat = b'{"messages": [{"role": "user", "content": "x \\udbff y"}]}'
    with httpx.Client(base_url=server.url, timeout=10) as client:
        statuses = [client.post("/v1/completions", content=b).status_code for b in bodies * 3]
        statuses.append(client.post("/v1/chat/completions", content=chat).status_code)
    return statuses


def long_prompts(server: Endpoint) -> list[int]:
    """Prompts 100x the context (as text and as token ids: refused uncounted / unvalidated), then text just
    within the character bound max_model_len tokens can hold (the 400 names it), which must be tokenized to be
    refused: on the worker pool, without holding the GIL. A 503 (the burst filled the queue) is retried."""
    def post(client: httpx.Client, prompt: str | list[int]) -> httpx.Response:
        for _ in range(50):
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
            if r.status_code != 503:
                break
            time.sleep(0.1)
        return r

    with httpx.Client(base_url=server.url, timeout=30) as client:
        answers = [post(client, prompt) for prompt in ("hello " * 100 * MAX_MODEL_LEN, [7] * 100 * MAX_MODEL_LEN)]
        bound = int(re.search(r"at most (\d+) characters", answers[0].json()["error"]["message"]).group(1))
        answers += [post(client, ("hello " * bound)[:bound]) for _ in range(3)]
    return [r.status_code for r in answers]


def queue_burst(server: Server | Endpoint, trickle: Trickle, count: int = 3 * MAX_NUM_SEQS) -> list[int]:
    """Streaming requests all at once: 503 beyond the queue bound, 200 (after a first token) for the rest; long
    enough (128 tokens) that none finishes while the burst is decided."""
    body = json.dumps({"prompt": "burst", "max_tokens": 128, "ignore_eos": True, "stream": True}).encode()
    with trickle.pause:
        socks = [raw(server) for _ in range(count)]
        for sock in socks:
            sock.sendall(post_bytes(body))
        heads = [sock.recv(12) for sock in socks]
    for sock in socks:
        sock.close()
    return [int(h.split()[1]) for h in heads]


def hostile_mix(server: Endpoint, go: Any, results: Any) -> None:
    """The hostile clients at once (once ``go`` is set), each on its thread, in a process of their own (so their
    Python work never holds the test's GIL while it times the trickle); puts {client: what it saw} on ``results``."""
    go.wait(60)
    seen: dict[str, object] = {}
    clients = {"large": large_bodies, "slowloris": slowloris, "aborts": abort_flood, "text": bad_text,
               "long": long_prompts}
    threads = [threading.Thread(target=lambda n=n, f=f: seen.__setitem__(n, f(server)), daemon=True)
               for n, f in clients.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    results.put(seen)


def hostile_round(server: Server, idle_rss: int) -> tuple[Trickle, Trickle, int]:
    """A baseline trickle alone, then the trickle under the hostile mix (whose clients' own checks are asserted
    here): (baseline, trickle, peak RSS while the mix ran)."""
    baseline = Trickle(server.url, count=BASELINE_REQUESTS)
    baseline.run()
    assert not baseline.failures, baseline.failures
    trickle = Trickle(server.url)
    peak_rss = [idle_rss]
    done = threading.Event()

    def sample_rss() -> None:
        while not done.is_set():
            peak_rss.append(server.rss_bytes())
            time.sleep(0.05)

    endpoint = Endpoint(server.url, server.port)
    readers = slow_readers(endpoint)
    context = multiprocessing.get_context("spawn")
    queue, go = context.Queue(), context.Event()
    mix = context.Process(target=hostile_mix, args=(endpoint, go, queue), daemon=True)
    mix.start()  # its start-up (imports) before the trickle is timed
    time.sleep(3)
    sampler = threading.Thread(target=sample_rss, daemon=True)
    trickle.start()
    sampler.start()
    time.sleep(0.5)
    go.set()
    time.sleep(1.5)
    burst = queue_burst(endpoint, trickle)
    results = queue.get(timeout=90)
    mix.join(10)
    time.sleep(0.5)
    trickle.stop.set()
    trickle.join(30)
    done.set()
    sampler.join(5)
    for sock in readers:
        sock.close()
    assert results["large"] == [413, 413, 413]
    assert results["slowloris"] == 24
    assert set(results["text"]) == {400}
    assert results["long"] == [400] * 5
    assert set(burst) <= {200, 503} and 503 in burst and burst.count(200) >= MAX_QUEUE, burst
    assert not trickle.failures, trickle.failures
    assert len(trickle.latencies) >= 20
    return baseline, trickle, max(peak_rss)


def test_normal_requests_keep_their_latency_under_hostile_traffic(server):
    kv_pool = float(re.search(r"KV pool: .* ([\d.]+) MiB", server.log_path.read_text()).group(1)) * 2**20
    Trickle(server.url, count=10).run()  # warm up: first-request costs are not the baseline's
    idle_rss = server.rss_bytes()
    rounds = []
    for _ in range(ROUNDS):
        baseline, trickle, peak_rss = hostile_round(server, idle_rss)
        base_p99, hostile_p99 = p99(baseline.latencies), p99(trickle.latencies)
        rounds.append((base_p99, hostile_p99))
        print(f"\ntrickle p99: alone {base_p99 * 1e3:.1f} ms, under hostile traffic {hostile_p99 * 1e3:.1f} ms "
              f"({len(trickle.latencies)} requests); RSS idle {idle_rss / 2**20:.0f} MiB, peak {peak_rss / 2**20:.0f} "
              f"MiB, KV pool {kv_pool / 2**20:.0f} MiB")
        assert peak_rss <= 1.2 * idle_rss + kv_pool
        deadline = time.monotonic() + 10
        while server.metric("kiln_kv_cache_blocks_used") > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.metric("kiln_kv_cache_blocks_used") == 0
        if hostile_p99 <= 2 * max(base_p99, P99_FLOOR_S):
            return
    raise AssertionError(f"trickle p99 (alone, under hostile traffic) in s: {rounds}")


def test_a_50_mb_body_is_413_and_a_prompt_100x_the_context_400_within_half_a_second(server):
    big = b'{"prompt": "' + b"x" * 50_000_000 + b'"}'
    times = []
    for _ in range(3):  # the best of three: another process's hiccup only ever adds time
        with raw(server) as sock:  # timed on a raw socket: httpx alone spends ~0.4 s here copying 50 MB about
            start = time.perf_counter()
            sock.sendall(post_bytes(big))  # the server answers after the headers and drops the rest as it comes
            answer = sock.recv(65536)
            while b"}}" not in answer:
                answer += sock.recv(65536)
            times.append(time.perf_counter() - start)
        assert answer.startswith(b"HTTP/1.1 413") and b'"code":"request_too_large"' in answer
    assert min(times) <= 0.5, times
    r = httpx.post(server.url + "/v1/completions", content=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    # timed with httpx: the openai client alone spends ~2 s here turning 25,600 token ids into its request
    for prompt, says in (("hello " * 100 * MAX_MODEL_LEN, "characters"), ([7] * 100 * MAX_MODEL_LEN, "tokens")):
        times = []
        for _ in range(3):  # the best of three: another process's hiccup only ever adds time
            start = time.perf_counter()
            r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=30)
            times.append(time.perf_counter() - start)
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == "prompt" and says in error["message"]
            assert f"max_seq_len ({MAX_MODEL_LEN})" in error["message"]
        assert min(times) <= 0.5, times


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost and its key (cryptography, else the openssl CLI)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                        "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
        return cert, key
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                               x509.DNSName("localhost")]), critical=False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(private, hashes.SHA256()))
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return cert, key


def test_tls_with_the_official_client_trusting_a_self_signed_certificate(tiny_engine, tmp_path):
    cert, key = self_signed(tmp_path)
    srv = Server(tiny_engine, tmp_path / "server.log", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                 "--num-threads", "1", "--max-model-len", str(MAX_MODEL_LEN), tls_ca=cert)
    try:
        assert srv.url.startswith("https://")
        done = srv.client().completions.create(model=None, prompt="Hello", max_tokens=3, temperature=0)
        assert done.usage.completion_tokens == 3
        chunks = list(srv.client().chat.completions.create(model=None, messages=[{"role": "user", "content": "hi"}],
                                                           max_tokens=3, stream=True))
        assert chunks and chunks[-1].choices[0].finish_reason is not None
        with pytest.raises(openai.APIConnectionError):  # a client that does not trust the certificate
            openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0).models.list()
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port
            httpx.get(srv.url.replace("https", "http") + "/health", timeout=5)
        assert "on https://127.0.0.1" in srv.log_path.read_text()
    finally:
        start = time.perf_counter()  # the clients above still hold idle TLS connections: closed, not waited on
        assert srv.stop() == 0 and time.perf_counter() - start < 15
