"""The HTTP layer of `kiln serve` against a fake AsyncLLM: wire format, errors, disconnects."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from server_fake import FakeAsyncLLM, post_completion_asgi  # noqa: E402

from kiln.errors import InvalidParamError  # noqa: E402
from kiln.runtime.server.app import build_app  # noqa: E402


@pytest.fixture
def fake():
    return FakeAsyncLLM()


@pytest.fixture
def client(fake):
    with TestClient(build_app(lambda: fake, max_queue=4)) as c:
        yield c


def sse_events(resp) -> list:
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [block for block in resp.text.split("\n\n") if block]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def assert_error(resp, status: int, param: str | None = None, contains: str = ""):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert contains in err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


# ---- completions ------------------------------------------------------------------------

def test_completion_non_streaming(client):
    r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "hello", "max_tokens": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert body["choices"] == [{"index": 0, "text": "abcd", "logprobs": None, "finish_reason": "length",
                                "stop_reason": None}]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 4
    assert body["usage"]["total_tokens"] == 9


def test_completion_streaming_sse(client):
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 5, "stream": True,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    chunks = sse_events(r)
    *deltas, usage = chunks
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in deltas)
    assert "".join(c["choices"][0]["text"] for c in deltas) == "abcde"
    assert [c["choices"][0]["finish_reason"] for c in deltas][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in deltas[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["prompt_tokens"] == 3


def test_completion_batch_and_n(client, fake):
    r = client.post("/v1/completions", json={"prompt": ["ab", "cd"], "n": 2, "max_tokens": 3})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["abc", "bcd", "abc", "bcd"]
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 12
    r = client.post("/v1/completions", json={"prompt": [[5, 6], [7]], "max_tokens": 2, "stream": True})
    texts: dict[int, str] = {}
    for c in sse_events(r):
        texts[c["choices"][0]["index"]] = texts.get(c["choices"][0]["index"], "") + c["choices"][0]["text"]
    assert texts == {0: "ab", 1: "ab"}


def test_stop_and_params_reach_engine(client, fake):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "stop": "d", "temperature": 0,
                                             "top_k": -1, "seed": 7, "presence_penalty": 0.5})
    assert r.json()["choices"][0]["text"] == "abc"
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    params = fake.requests[-1][1]
    assert params.temperature == 0 and params.top_k == 0 and params.seed == 7 and params.stop == ("d",)
    assert params.presence_penalty == 0.5 and params.max_tokens == 8


def test_completion_logprobs(client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b", "c"] and lp["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert lp["top_logprobs"][0] == {"a": -0.5, "b": -2.0} and lp["text_offset"] == [0, 1, 2]


# ---- chat ---------------------------------------------------------------------------------

def test_chat_non_streaming(client, fake):
    r = client.post("/v1/chat/completions", json={
        "model": "fake-model", "max_completion_tokens": 3,
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "abc"}
    assert fake.requests[-1][0] == "<system>be brief<user>hi<assistant>"


def test_chat_streaming_and_logprobs(client):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
        "logprobs": True, "top_logprobs": 2})
    chunks = sse_events(r)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "abc"
    lp = chunks[0]["choices"][0]["logprobs"]["content"][0]
    assert lp["token"] == "a" and lp["logprob"] == -0.5 and len(lp["top_logprobs"]) == 2


def test_chat_defaults_to_context_length(client, fake):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    assert fake.requests[-1][1].max_tokens is None


# ---- errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("payload,param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": "1"}, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": []}, "prompt"),
])
def test_bad_parameter_is_400_naming_field(client, payload, param):
    err = assert_error(client.post("/v1/completions", json=payload), 400)
    assert err["param"].split(".")[0] == param and param in err["message"]
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("payload,param", [
    ({"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "suffix": "end"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
])
def test_unsupported_openai_fields_are_rejected_not_ignored(client, payload, param):
    err = assert_error(client.post("/v1/completions", json=payload), 400)
    assert err["param"] == param and "not supported" in err["message"]


def test_tool_and_format_fields_are_checked_and_defaults_pass(client):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    tool = {"type": "function", "function": {"name": "f"}}
    assert_error(client.post("/v1/chat/completions", json={**chat, "tools": [tool]}), 400,
                 "tools.0.function.parameters")
    assert_error(client.post("/v1/chat/completions", json={**chat, "tool_choice": "auto"}), 400, "tool_choice",
                 "needs tools")
    assert_error(client.post("/v1/chat/completions", json={**chat, "response_format": {"type": "xml"}}),
                 400, "response_format.type")
    assert_error(client.post("/v1/completions", json={"prompt": "x", "tools": [tool]}), 400, "tools",
                 "not supported")
    ok = {**chat, "logit_bias": {}, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}}
    assert client.post("/v1/chat/completions", json=ok).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "x", "echo": False, "best_of": 1}).status_code == 200


def test_chat_parameter_errors(client):
    assert_error(client.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    assert_error(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}), 400, "top_logprobs")
    assert_error(client.post("/v1/chat/completions", json={
        "messages": [{"role": "wizard", "content": "hi"}]}), 400)
    assert_error(client.post("/v1/chat/completions", json={
        "messages": [{"role": "assistant", "content": "REJECT"}]}), 400, "messages")


def test_invalid_json_is_400(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400, contains="JSON")
    assert_error(client.post("/v1/completions", json=[1, 2]), 400)


def test_unknown_model_is_404(client):
    err = assert_error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model")
    assert err["code"] == "model_not_found"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt_len,param", [(60, "max_tokens"), (64, "prompt")])
def test_too_long_is_400_naming_what_to_shorten(client, stream, prompt_len, param):
    r = client.post("/v1/completions", json={"prompt": "x" * prompt_len, "max_tokens": 10, "stream": stream})
    assert_error(r, 400, param, contains="max_seq_len")


def _engine_raising(fake, monkeypatch, exc: Exception) -> None:
    """The engine refuses the request when preparing it (tokenizing and checking, on a worker thread)."""
    def prepare_request(prompt, params, request_id):
        raise exc

    monkeypatch.setattr(fake, "prepare_request", prepare_request)


@pytest.mark.parametrize("stream", [False, True])
def test_engine_validation_error_is_400_with_the_param_it_carries(client, fake, monkeypatch, stream):
    """param comes from the error, not from the message (whose first word here is another field)."""
    _engine_raising(fake, monkeypatch, InvalidParamError("stop ids must be below the vocabulary size, got 99999",
                                                         "stop_token_ids"))
    r = client.post("/v1/completions", json={"prompt": "x", "stream": stream})
    err = assert_error(r, 400, "stop_token_ids", contains="below the vocabulary size")
    assert err["type"] == "invalid_request_error"


def test_a_bare_value_error_in_the_engine_is_a_500_not_a_400(client, fake, monkeypatch):
    _engine_raising(fake, monkeypatch, ValueError("operands could not be broadcast together"))
    err = assert_error(client.post("/v1/completions", json={"prompt": "x"}), 500)
    assert err["param"] is None


def test_queue_bound_is_503_with_retry_after(client, fake):
    fake.num_waiting = 4
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert_error(r, 503)
    assert r.headers["retry-after"] == "1"
    fake.num_waiting = 3
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_engine_exception_is_500_and_server_survives(client):
    assert_error(client.post("/v1/completions", json={"prompt": "CRASH"}), 500)
    assert_error(client.post("/v1/completions", json={"prompt": "CRASH", "stream": True}), 500)
    assert client.post("/v1/completions", json={"prompt": "ok"}).status_code == 200


def test_unknown_route_and_method(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)


# ---- models, health, metrics, lifespan ------------------------------------------------------

def test_models_health_metrics(client):
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "fake-model" and models["data"][0]["max_model_len"] == 64
    assert client.get("/health").status_code == 200
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    text = client.get("/metrics").text
    for name in ("kiln_num_requests_running", "kiln_num_requests_waiting", "kiln_kv_cache_blocks_used",
                 "kiln_kv_cache_blocks_total", "kiln_kv_cache_usage", "kiln_time_to_first_token_seconds_bucket",
                 "kiln_inter_token_latency_seconds_bucket", "kiln_generation_tokens_total"):
        assert name in text, name
    assert 'kiln_request_success_total{finish_reason="length"} 1.0' in text
    assert "kiln_prefix_cache_hit_rate 0.4" in text
    assert "kiln_output_tokens_total 3.0" in text
    assert "kiln_spec_acceptance_rate 0.625" in text  # 10 of 16 proposals kept
    assert "kiln_spec_tokens_per_verification 3.5" in text  # 1 + 10 / 4
    assert "kiln_spec_accepted_tokens_total 10.0" in text


def test_served_model_name_and_shutdown(fake):
    with TestClient(build_app(lambda: fake, served_model_name="alias")) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == "alias"
        assert c.post("/v1/completions", json={"model": "alias", "prompt": "x"}).status_code == 200
        assert c.post("/v1/completions", json={"model": "fake-model", "prompt": "x"}).status_code == 200
    assert fake.shut_down


# ---- disconnects ---------------------------------------------------------------------------

async def _asgi_request(app, body: dict, disconnect_after_chunks: int) -> list[bytes]:
    """Drive the app over raw ASGI; the client vanishes after receiving N body chunks."""
    gone = asyncio.Event()
    chunks: list[bytes] = []

    def on_message(message: dict) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
            if len(chunks) >= disconnect_after_chunks:
                gone.set()

    if disconnect_after_chunks == 0:
        asyncio.get_running_loop().call_later(0.05, gone.set)
    await asyncio.wait_for(post_completion_asgi(app, body, on_message, gone), timeout=10)
    return chunks


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_request(stream):
    fake = FakeAsyncLLM(token_delay=0.01)
    app = build_app(lambda: fake)

    async def main():
        async with app.router.lifespan_context(app):
            chunks = await _asgi_request(app, {"prompt": "x", "max_tokens": 50, "stream": stream},
                                         disconnect_after_chunks=3 if stream else 0)
            await asyncio.sleep(0.05)
            return chunks

    chunks = asyncio.run(main())
    assert len(fake.aborted) == 1 and not fake.running and not fake.finished
    metrics = app.state.metrics.render()
    assert b"kiln_request_abort_total 1.0" in metrics and b"kiln_request_success_total{" not in metrics
    assert fake.generated < 50
    if stream:
        assert b"[DONE]" not in b"".join(chunks)


def test_openapi_documents_400_not_422(client):
    spec = client.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"200", "400", "404", "503"} <= set(responses)
    props = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["temperature"]["anyOf"][0]["maximum"] == 2 and "prompt" in props


def test_stream_logprobs_of_tokens_without_text_yet_go_with_the_next_chunk():
    """A token that completes no character (or ends in a held-back stop prefix) adds no text:
    its chunk is skipped, and its logprobs ride with the next chunk that has text."""
    from kiln.runtime.outputs import CompletionOutput, Logprob, RequestOutput
    from kiln.runtime.params import SamplingParams
    from kiln.runtime.server.formatting import ResponseFormatter

    fmt = ResponseFormatter(False, "cmpl-1", "m", SamplingParams(logprobs=0))

    def delta(text, tokens, finish=None):
        lps = [{t: Logprob(-1.0, 1, chr(t))} for t in tokens]
        return RequestOutput("r", "p", [1], [CompletionOutput(0, text, tokens, -1.0, lps, finish)], finish is not None)

    first = fmt.chunks(0, delta("a", [97]), False)
    assert [c["choices"][0]["text"] for c in first] == ["a"]
    assert fmt.chunks(0, delta("", [98]), False) == []
    last = fmt.chunks(0, delta("bc", [99], "length"), False)
    choice = last[0]["choices"][0]
    assert choice["text"] == "bc" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["b", "c"] and choice["logprobs"]["text_offset"] == [1, 2]
