"""The shutdown deadline (streams.Drain), in-process on the fake engine: what runs past it ends
with an error event and [DONE] (streams) or a 503 (non-streaming), its engine requests aborted."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
from server_fake import FakeAsyncLLM  # noqa: E402

from kiln.runtime.server.app import build_app  # noqa: E402


async def _request(app, body: dict) -> tuple[int, bytes]:
    """One raw-ASGI POST /v1/completions: (status, whole body); the client never hangs up."""
    sent = False
    status, chunks = 0, []

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await asyncio.Event().wait()  # stays connected

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return status, b"".join(chunks)


def _shutdown_during(fake: FakeAsyncLLM, body: dict, timeout: float) -> tuple[int, bytes, bytes]:
    """Start a request, begin shutting down with ``timeout``; (status, body, /metrics) once it ends."""
    app = build_app(lambda: fake)

    async def main():
        async with app.router.lifespan_context(app):
            task = asyncio.create_task(_request(app, body))
            await asyncio.sleep(0.1)  # it is running
            app.state.drain.start(timeout)
            status, data = await task
            return status, data, app.state.metrics.render()

    return asyncio.run(main())


def test_a_stream_past_the_deadline_ends_with_an_error_event_and_done():
    fake = FakeAsyncLLM(token_delay=0.02)
    status, data, metrics = _shutdown_during(fake, {"prompt": "x", "max_tokens": 60, "stream": True}, 0.2)
    assert status == 200
    events = [e[len("data: "):] for e in data.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutting_down" and "0.2 s deadline" in error["message"]
    texts = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
    assert 0 < len(texts) < 60  # it was cut, after streaming some
    assert fake.aborted and not fake.running
    assert b"kiln_request_abort_total 1.0" in metrics  # an abort, not a success
    assert b'finish_reason="abort"' not in metrics


def test_a_request_that_ends_before_the_deadline_is_untouched():
    fake = FakeAsyncLLM(token_delay=0.01)
    status, data, _ = _shutdown_during(fake, {"prompt": "x", "max_tokens": 20, "stream": True}, 5.0)
    events = [e[len("data: "):] for e in data.decode().split("\n\n") if e]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert not fake.aborted


def test_a_non_streaming_request_past_the_deadline_is_a_503():
    fake = FakeAsyncLLM(token_delay=0.02)
    status, data, _ = _shutdown_during(fake, {"prompt": "x", "max_tokens": 60}, 0.2)
    assert status == 503
    assert json.loads(data)["error"]["code"] == "server_shutting_down"
    assert fake.aborted
