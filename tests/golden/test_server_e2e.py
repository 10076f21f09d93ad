"""`kiln serve` as a real subprocess, driven by the official openai client: the text served over
HTTP is the text LLM.generate produces; disconnecting clients free their blocks; SIGTERM
lets in-flight requests finish and exits 0."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from server_process import Server  # noqa: E402

from kiln.runtime import LLM, SamplingParams  # noqa: E402

PROMPTS = [f"The number {i} is" for i in range(16)]


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    srv = Server(tiny_engine, tmp_path_factory.mktemp("serve") / "server.log")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def reference(tiny_engine):
    return LLM(tiny_engine)


def _greedy_outputs(llm: LLM, prompts, max_tokens: int):
    return [o.outputs[0] for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))]


def _greedy(llm: LLM, prompts, max_tokens: int) -> list[str]:
    return [o.text for o in _greedy_outputs(llm, prompts, max_tokens)]


def test_completions_match_llm(server, reference):
    want = _greedy_outputs(reference, PROMPTS[:4], 12)
    client = server.client()
    model = client.models.list().data[0].id
    got = client.completions.create(model=model, prompt=PROMPTS[:4], max_tokens=12, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [o.text for o in want]
    assert got.usage.completion_tokens == sum(len(o.token_ids) for o in want)
    stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want[0].text
    assert chunks[-1].usage.completion_tokens == len(want[0].token_ids)
    assert '"POST /v1/completions HTTP/1.1" 200' in server.log_path.read_text()  # uvicorn's access line, by default


def test_chat_matches_llm(server, reference):
    messages = [{"role": "user", "content": "Say hello."}]
    want = reference.chat(messages, SamplingParams(temperature=0, max_tokens=10))[0].outputs[0].text
    client = server.client()
    got = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                         max_completion_tokens=10, temperature=0)
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=got.model, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, logprobs=True, top_logprobs=2)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert len(chunks[0].choices[0].logprobs.content[0].top_logprobs) == 2


def test_errors_over_http(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_seq_len"):
        client.completions.create(model=client.models.list().data[0].id, prompt="x", max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=client.models.list().data[0].id, prompt="x", temperature=-3)


def test_64_streams_16_disconnect(server, reference):
    """48 clients read to the end and get LLM's text; 16 hang up midway; the pool ends empty."""
    max_tokens = 24
    want = _greedy(reference, PROMPTS, max_tokens)

    async def one(client, i: int) -> str | None:
        quit_after = 3 if i % 4 == 0 else None  # these ask for 200 tokens, so they surely hang up midway
        stream = await client.completions.create(model=model, prompt=PROMPTS[i % 16], temperature=0, stream=True,
                                                 max_tokens=200 if quit_after else max_tokens,
                                                 extra_body={"ignore_eos": bool(quit_after)})
        text = ""
        async for n, chunk in _enumerate(stream):
            text += chunk.choices[0].text
            if quit_after is not None and n + 1 >= quit_after:
                await stream.close()
                return None
        return text

    async def main():
        async with server.async_client(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    model = server.client().models.list().data[0].id
    before, aborted_before = server.finished(), server.aborted()
    results = asyncio.run(main())
    assert sum(r is None for r in results) == 16
    for i, text in enumerate(results):
        if text is not None:
            assert text == want[i % 16], i

    def settled():
        done = sum(server.finished().values()) - sum(before.values()) + server.aborted() - aborted_before
        return server.metric("kiln_kv_cache_blocks_used") == 0 and done == 64

    deadline = time.monotonic() + 10
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("kiln_kv_cache_blocks_used") == 0
    assert server.metric("kiln_num_requests_running") == 0
    assert server.metric("kiln_num_requests_waiting") == 0
    after = server.finished()
    counted = {reason: after[reason] - before.get(reason, 0.0) for reason in after}
    aborted = server.aborted() - aborted_before
    assert "abort" not in counted and sum(counted.values()) + aborted == 64
    # a hang-up is an abort unless the fast tiny engine finished those 200 tokens before the server saw it
    assert 0 < aborted <= 16


def test_bench_against_server(server, tiny_engine, tmp_path, capsys):
    from kiln.runtime.bench.offline import BenchConfig
    from kiln.runtime.bench.serving import bench_server

    report = bench_server(server.url, str(tiny_engine), BenchConfig(num_requests=8, input_len=16, output_len=8),
                          (4,), str(tmp_path / "report.json"))
    (run,) = report["runs"]
    assert run["num_errors"] == 0 and run["config"]["concurrency"] == 4
    elapsed = run["elapsed_s"]  # rounded to 0.1 ms; a fast run's rate comes from the unrounded time
    assert 64 / (elapsed + 5e-5) * 0.999 <= run["output_tok_per_s"] <= 64 / max(elapsed - 5e-5, 1e-6) * 1.001
    assert run["ttft_ms"]["p50"] > 0 and run["itl_ms"]["p99"] >= run["itl_ms"]["p50"]
    assert '"requests_per_s"' in capsys.readouterr().out and (tmp_path / "report.json").is_file()


async def _enumerate(aiter):
    n = 0
    async for item in aiter:
        yield n, item
        n += 1


def test_sigterm_finishes_in_flight_and_exits_0(tiny_engine, tmp_path):
    srv = Server(tiny_engine, tmp_path / "server.log")
    try:
        client = srv.client(timeout=60)
        stream = client.completions.create(model=client.models.list().data[0].id, prompt="Count:", max_tokens=300,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        text = next(chunks).choices[0].text
        srv.proc.send_signal(signal.SIGTERM)
        finish = None
        for chunk in chunks:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "length"
        assert srv.proc.wait(timeout=30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health", timeout=2)
    finally:
        srv.stop()


@pytest.mark.slow
def test_smollm2_over_http_matches_llm(smollm2_engine, tmp_path):
    """The real model: chat and completions served over HTTP are LLM's greedy text, token for token."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    llm = LLM(smollm2_engine)
    want_chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text
    want_text = _greedy(llm, ["The capital of France is", "def fibonacci(n):"], 16)
    del llm
    srv = Server(smollm2_engine, tmp_path / "server.log")
    try:
        client = srv.client(timeout=120)
        model = client.models.list().data[0].id
        got = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
        assert got.choices[0].message.content == want_chat
        assert "Paris" in want_chat
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == want_chat
        got = client.completions.create(model=model, prompt=["The capital of France is", "def fibonacci(n):"],
                                        max_tokens=16, temperature=0)
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want_text
    finally:
        assert srv.stop() == 0
