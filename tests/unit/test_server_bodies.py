"""What a request costs before the engine sees it, on the fake engine: bodies past --max-request-bytes
are 413 unparsed, prompts longer than max_model_len tokens can hold are 400 untokenized (token-id
prompts longer than max_model_len before their ids are validated), text that is
no Unicode (invalid UTF-8, lone surrogates) is a 400 naming the field, and the work that can be slow
(decoding the body, rendering the chat template, tokenizing) runs on the worker pool, never on the
event loop's thread, unless it is smaller than the trip to a worker."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("fastapi")
from fake_runner import CharTokenizer  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from server_fake import FakeAsyncLLM  # noqa: E402

from kiln.runtime.detokenizer import max_prompt_chars  # noqa: E402
from kiln.runtime.server import admission, bodies  # noqa: E402
from kiln.runtime.server import app as app_module  # noqa: E402
from kiln.runtime.server.app import build_app  # noqa: E402
from kiln.runtime.server.limits import RequestLimits, default_max_request_bytes  # noqa: E402

LIMIT = 4096


@pytest.fixture
def fake():
    return FakeAsyncLLM()


@pytest.fixture
def client(fake):
    with TestClient(build_app(lambda: fake, limits=RequestLimits(max_request_bytes=LIMIT))) as c:
        yield c


def error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_a_body_past_the_limit_is_413_and_never_parsed(client, fake, monkeypatch):
    decoded = []
    monkeypatch.setattr(bodies, "decode", lambda raw, model: decoded.append(raw))
    r = client.post("/v1/completions", content=b"{" * (LIMIT + 1), headers={"content-type": "application/json"})
    err = error(r, 413)
    assert err["code"] == "request_too_large" and str(LIMIT) in err["message"]
    assert r.headers["connection"] == "close" and decoded == []

    def chunks():  # no Content-Length: counted as it streams in
        for _ in range(8):
            yield b"x" * 1024

    assert error(client.post("/v1/completions", content=chunks()), 413)["type"] == "invalid_request_error"
    assert decoded == [] and fake.requests == []


def test_the_default_limit_follows_the_context_length():
    assert default_max_request_bytes(256) == 1 << 20
    assert default_max_request_bytes(8192) == 8192 * 1024
    with pytest.raises(ValueError, match="max_request_bytes"):
        RequestLimits(max_request_bytes=0)


def test_a_prompt_longer_than_the_context_can_hold_is_400_untokenized(client, fake, monkeypatch):
    prepared = []
    monkeypatch.setattr(fake, "prepare_request", lambda *args: prepared.append(args))
    err = error(client.post("/v1/completions", json={"prompt": "x" * (fake.max_seq_len + 1)}), 400)
    assert err["param"] == "prompt" and f"{fake.max_seq_len + 1} characters" in err["message"]
    assert f"max_seq_len ({fake.max_seq_len})" in err["message"]
    err = error(client.post("/v1/completions", json={"prompt": ["ok", "y" * 1000]}), 400)
    assert err["param"] == "prompt" and prepared == []

    ids = [7] * (fake.max_seq_len + 1)  # counted before pydantic checks each id
    for prompt in (ids, [[7, 8], ids]):
        err = error(client.post("/v1/completions", json={"prompt": prompt}), 400)
        assert err["param"] == "prompt"
        assert err["message"] == f"prompt has {len(ids)} tokens, more than max_seq_len ({fake.max_seq_len})"
    assert prepared == []

    rendered = []
    monkeypatch.setattr(fake, "apply_chat_template", lambda *args: rendered.append(args))
    long_chat = [{"role": "user", "content": "a" * 40}, {"role": "user", "content": "b" * 40}]
    err = error(client.post("/v1/chat/completions", json={"messages": long_chat}), 400)
    assert err["param"] == "messages" and "80 characters" in err["message"] and rendered == []


@pytest.mark.parametrize("body,param", [
    (b'{"prompt": "a\\ud800b"}', "prompt"),
    (b'{"prompt": ["ok", "\\udfff"]}', "prompt"),
    (b'{"prompt": "x", "stop": ["\\udbff"]}', "stop"),
])
def test_lone_surrogates_are_400_naming_the_field(client, body, param):
    err = error(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400)
    assert err["param"] == param and "lone surrogate" in err["message"]


def test_lone_surrogates_in_chat_and_invalid_utf8_are_400(client):
    chat = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}'
    err = error(client.post("/v1/chat/completions", content=chat), 400)
    assert err["param"].startswith("messages.0.content") and "U+D83D" in err["message"]
    err = error(client.post("/v1/completions", content=b'{"prompt": "caf\xe9"}'), 400)
    assert "not UTF-8" in err["message"]
    assert client.post("/v1/completions", json={"prompt": "caf\u00e9 \U0001f600", "max_tokens": 2}).status_code == 200


def _record_threads(fake, monkeypatch) -> dict[str, str]:
    """{work: the name of the thread that did it} for the server's CPU work around the engine."""
    threads: dict[str, str] = {}
    decode, prepare, render = bodies.decode, fake.prepare_request, fake.apply_chat_template

    def record(name, fn):
        def wrapped(*args, **kwargs):
            threads[name] = threading.current_thread().name
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(bodies, "decode", record("decode", decode))
    monkeypatch.setattr(fake, "prepare_request", record("prepare", prepare))
    monkeypatch.setattr(fake, "apply_chat_template", record("render", render))
    monkeypatch.setattr(fake, "tokenize", record("tokenize", fake.tokenize))
    monkeypatch.setattr(fake, "detokenize", record("detokenize", fake.detokenize))
    return threads


def _every_kind_of_work(client) -> None:
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2}).status_code == 200
    assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 200
    assert client.post("/detokenize", json={"tokens": [104, 105]}).json()["prompt"] == "hi"


def test_slow_work_runs_on_the_worker_pool(client, fake, monkeypatch):
    """Past its kind's inline bound (here: all of it), the work runs on the pool's threads, not the loop's."""
    threads = _record_threads(fake, monkeypatch)
    for name in ("INLINE_BODY_BYTES", "INLINE_TEMPLATE_BYTES", "INLINE_TOKENIZE_CHARS", "INLINE_TOKEN_IDS"):
        for module in (bodies, admission, app_module):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, 0)
    _every_kind_of_work(client)
    assert set(threads) == {"decode", "prepare", "render", "tokenize", "detokenize"}
    assert all(name.startswith("kiln-http") for name in threads.values()), threads


def test_a_short_request_is_served_on_the_event_loop_and_a_structured_one_prepared_on_the_pool(client, fake,
                                                                                               monkeypatch):
    """Work smaller than a trip to a worker stays on the loop's thread; a grammar (which may take long to
    compile) is prepared on the pool however short the prompt."""
    threads = _record_threads(fake, monkeypatch)
    _every_kind_of_work(client)
    assert set(threads) == {"decode", "prepare", "render", "tokenize", "detokenize"}
    assert len(set(threads.values())) == 1 and not threads["decode"].startswith("kiln-http"), threads
    threads.clear()
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                "response_format": {"type": "json_object"}}).status_code == 200
    assert threads["prepare"].startswith("kiln-http") and not threads["decode"].startswith("kiln-http"), threads


def test_max_prompt_chars_is_the_context_times_the_longest_token():
    assert max_prompt_chars(CharTokenizer(), 64, 100) == 100  # one character a token

    class WithSpecial(CharTokenizer):
        def id_to_token(self, token_id: int) -> str | None:
            return "<|endoftext|>" if token_id == 3 else super().id_to_token(token_id)

    assert max_prompt_chars(WithSpecial(), 64, 100) == 100 * len("<|endoftext|>")
