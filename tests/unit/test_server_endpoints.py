"""/v1/models/{id}, /tokenize, /detokenize, /version, the API key, the request log line and the
small API truths (integral floats, NaN, aborts), on the fake engine; where the
official openai client has a call for it, through that client (in-process, over TestClient)."""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from fastapi.testclient import TestClient  # noqa: E402
from server_fake import FakeAsyncLLM  # noqa: E402

import kiln  # noqa: E402
from kiln.runtime.server.app import build_app  # noqa: E402

KEY = "sk-test-123"


@pytest.fixture
def fake():
    return FakeAsyncLLM()


@pytest.fixture
def client(fake):
    with TestClient(build_app(lambda: fake, served_model_name="org/alias")) as c:
        yield c


def official(http: TestClient, api_key: str = "none"):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=api_key, http_client=http, max_retries=0)


# ---- models, version ----------------------------------------------------------------------

def test_models_retrieve(client):
    oai = official(client)
    for name in ("org/alias", "fake-model"):  # the served name, with a slash, and the engine's own
        card = oai.models.retrieve(name)
        assert card.id == "org/alias" and card.owned_by == "kiln" and card.model_extra["max_model_len"] == 64
    with pytest.raises(openai.NotFoundError) as err:
        oai.models.retrieve("gpt-9")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    assert "gpt-9" in err.value.body["message"]


def test_version(client):
    assert client.get("/version").json() == {"version": kiln.__version__}


# ---- tokenize / detokenize (vLLM's shapes) ------------------------------------------------

def test_tokenize_prompt_and_messages(client):
    r = client.post("/tokenize", json={"model": "org/alias", "prompt": "hi"})
    assert r.json() == {"count": 3, "max_model_len": 64, "tokens": [1, 104, 105], "token_strs": None}
    r = client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False, "return_token_strs": True})
    assert r.json()["tokens"] == [104, 105] and r.json()["token_strs"] == ["<h>", "<i>"]
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "yo"}]})
    assert r.json()["tokens"] == [ord(c) for c in "<user>yo<assistant>"]  # no special tokens: the template has them
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "yo"}],
                                       "add_generation_prompt": False})
    assert r.json()["tokens"] == [ord(c) for c in "<user>yo"]


@pytest.mark.parametrize("body,param", [
    ({}, None), ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
    ({"prompt": 5}, "prompt"), ({"model": "gpt-9", "prompt": "a"}, "model"),
])
def test_tokenize_errors(client, body, param):
    r = client.post("/tokenize", json=body)
    assert r.status_code == (404 if param == "model" else 400)
    assert r.json()["error"]["param"] == param
    if not body or "messages" in body:
        assert "exactly one of prompt or messages" in r.json()["error"]["message"]


def test_detokenize(client):
    assert client.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    r = client.post("/detokenize", json={"tokens": [2**30]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert client.post("/detokenize", json={"tokens": [-1]}).status_code == 400


# ---- the API key ---------------------------------------------------------------------------

@pytest.fixture
def locked(fake):
    with TestClient(build_app(lambda: fake, api_key=KEY)) as c:
        yield c


def test_api_key_through_the_official_client(locked):
    done = official(locked, KEY).completions.create(model="fake-model", prompt="x", max_tokens=2)
    assert done.choices[0].text == "ab"
    assert official(locked, KEY).models.retrieve("fake-model").id == "fake-model"
    with pytest.raises(openai.AuthenticationError) as err:
        official(locked, "wrong").completions.create(model="fake-model", prompt="x", max_tokens=2)
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        official(locked, "wrong").models.list()


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("GET", "/v1/models/fake-model"),
                                         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                         ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"),
                                         ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/nothing")])
def test_every_route_but_health_needs_the_key(locked, method, path):
    r = locked.request(method, path, json={})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Missing API key" in err["message"]
    r = locked.request(method, path, json={}, headers={"Authorization": f"Bearer {KEY}x"})
    assert r.status_code == 401 and r.json()["error"]["message"] == "Incorrect API key provided."
    r = locked.request(method, path, json={}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code != 401


def test_health_needs_no_key_and_rejections_are_counted(locked):
    assert locked.get("/health").status_code == 200
    locked.get("/v1/models")
    metrics = locked.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'kiln_request_rejected_total{status="401"} 1.0' in metrics


def test_an_empty_api_key_is_refused():
    with pytest.raises(ValueError, match="^api_key must be a non-empty string"):
        build_app(lambda: None, api_key="")


# ---- small API truths ------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["max_tokens", "n", "seed", "top_k", "logprobs"])
def test_an_integral_float_is_an_integer(client, fake, field):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, field: 4.0})
    assert r.status_code == 200, r.text
    assert getattr(fake.requests[-1][1], field) == 4 and type(getattr(fake.requests[-1][1], field)) is int
    r = client.post("/v1/completions", json={"prompt": "x", field: 4.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_chat_max_completion_tokens_as_float(client, fake):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                  "max_completion_tokens": 3.0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "abc"


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty"])
@pytest.mark.parametrize("value", ["NaN", "Infinity"])
def test_nan_and_infinity_have_their_own_message(client, field, value):
    body = '{"prompt": "x", "' + field + '": ' + value + "}"
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert r.json()["error"]["message"] == f"{field}: Input should be a finite number"


# ---- request logging ------------------------------------------------------------------------

def test_one_log_line_per_request(client, caplog):
    with caplog.at_level(logging.INFO, logger="kiln.server"):
        client.post("/v1/completions", json={"prompt": "hey", "max_tokens": 3})
        client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2, "stream": True})
    lines = [r.getMessage() for r in caplog.records if r.name == "kiln.server"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("cmpl-") and "prompt_tokens=3 output_tokens=3 finish_reason=length latency=" in lines[0]
    assert "prompt_tokens=2 output_tokens=8 finish_reason=length,length,length,length" in lines[1]


def test_openapi_lists_the_new_routes(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/models/{model}", "/tokenize", "/detokenize", "/version"} <= set(paths)
    assert json.dumps(paths["/tokenize"]).count("TokenizeRequest") >= 1
