"""The chat page's routes (kiln.runtime.server.web): content types, the CSP, no other origin, --no-web-ui.
What the page does in a browser is tests/engine/test_web_ui_browser.py."""

from __future__ import annotations

import re
from fnmatch import fnmatch
from html.parser import HTMLParser
from pathlib import Path

import pytest
import tomllib

pytest.importorskip("fastapi")
from chat_page_js import NODE, run_chat_js  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from server_fake import FakeAsyncLLM  # noqa: E402

from kiln.runtime.server.app import build_app  # noqa: E402
from kiln.runtime.server.web import ASSETS, add_web_ui, read_asset  # noqa: E402


@pytest.fixture
def client():
    app = build_app(lambda: FakeAsyncLLM())
    add_web_ui(app)
    with TestClient(app) as c:
        yield c


class _Page(HTMLParser):
    """What the page loads (src/href) and whether it carries inline code."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[str] = []
        self.inline: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        self.loads += [v for k, v in attrs if k in ("src", "href") and v is not None]
        self.inline += [f"{tag} {k}=" for k, _ in attrs if k == "style" or k.startswith("on")]
        if tag == "style" or (tag == "script" and "src" not in named):
            self.inline.append(f"<{tag}> element")


def page() -> _Page:
    parsed = _Page()
    parsed.feed(read_asset("index.html").decode())
    return parsed


@pytest.mark.parametrize("path", list(ASSETS))
def test_each_asset_is_served_with_its_type_and_the_csp(client, path):
    resp = client.get(path)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == ASSETS[path][1]
    assert resp.content == read_asset(ASSETS[path][0])
    assert resp.headers["x-content-type-options"] == "nosniff"
    csp = dict(d.strip().split(" ", 1) for d in resp.headers["content-security-policy"].split(";"))
    assert csp["default-src"] == "'none'"
    # nothing from another origin: every source list is 'self' or 'none' (no host, scheme, * or 'unsafe-inline'),
    # but images may also be blob: URLs, which only the page itself makes (from files the user attaches)
    assert csp.pop("img-src") == "'self' blob:"
    assert all(v in ("'self'", "'none'") for v in csp.values()), csp


def test_the_page_loads_only_same_origin_files_the_server_has(client):
    loads = page().loads
    assert sorted(loads) == sorted(p for p in ASSETS if p != "/")
    assert all(client.get(src).status_code == 200 for src in loads)


def test_the_page_has_no_inline_code_the_csp_would_block():
    assert page().inline == []
    script = read_asset("chat.js").decode()
    assert not re.search(r"https?://|\beval\(|new Function\(", script)  # no other origin, no code from strings
    assert not re.search(r"\.innerHTML\s*=", script)  # model text goes in as text, never as markup


def test_the_page_talks_to_this_server_only():
    script = read_asset("chat.js").decode()
    assert sorted(set(re.findall(r'fetch\("([^"]+)"', script))) == ["/v1/chat/completions", "/v1/models"]


def test_unknown_static_paths_are_404_in_openais_shape(client):
    for path in ("/static/../app.py", "/static/nope.js", "/index.html"):
        resp = client.get(path)
        assert resp.status_code == 404 and resp.json()["error"]["message"], path


def test_head_answers_like_get_without_a_body(client):
    resp = client.head("/")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html") and not resp.content


def test_the_page_opens_without_the_api_key_the_api_asks_for():
    """A browser opening / cannot send a key; the page asks for it and sends it with its API calls."""
    app = build_app(lambda: FakeAsyncLLM(), api_key="sekrit")
    add_web_ui(app)
    with TestClient(app) as c:
        for path in ASSETS:
            assert c.get(path).status_code == 200, path
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200


def test_without_the_web_ui_root_is_a_404():
    with TestClient(build_app(lambda: FakeAsyncLLM())) as c:
        resp = c.get("/")
        assert resp.status_code == 404 and "error" in resp.json()
        assert c.get("/static/chat.js").status_code == 404


def test_the_pages_are_left_out_of_the_openapi_schema(client):
    assert not set(client.get("/openapi.json").json()["paths"]) & set(ASSETS)


@pytest.mark.parametrize(("flags", "has_page"), [((), True), (("--no-web-ui",), False)])
def test_serve_has_the_page_unless_no_web_ui(monkeypatch, tmp_path, flags, has_page):
    from click.testing import CliRunner

    import kiln.runtime.server.launch as launch
    from kiln.cli import main

    apps = []
    monkeypatch.setattr(launch, "serve", lambda engine_dir, config, options: apps.append(
        launch.serving_app(FakeAsyncLLM, options)))
    result = CliRunner().invoke(main, ["serve", str(tmp_path), *flags])
    assert result.exit_code == 0, result.output
    with TestClient(apps[0]) as c:
        assert (c.get("/").status_code == 200) is has_page


def test_the_assets_ship_as_package_data():
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["kiln.runtime.server"]
    for name, _ in ASSETS.values():
        assert any(fnmatch(f"static/{name}", p) for p in patterns), f"{name} is not in the wheel"


class _Controls(HTMLParser):
    """The page's elements by id: (tag, attributes)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, tuple[str, dict[str, str | None]]] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        if named.get("id"):
            self.by_id[str(named["id"])] = (tag, named)


def test_the_image_button_is_hidden_until_the_model_reads_images(client):
    """The attach button and its file picker (images only) start hidden; the page shows the button when the model
    card lists the image modality, which a text engine's does not."""
    controls = _Controls()
    controls.feed(read_asset("index.html").decode())
    tag, attach = controls.by_id["attach"]
    assert tag == "button" and "hidden" in attach
    tag, picker = controls.by_id["image-file"]
    assert tag == "input" and picker["type"] == "file" and picker["accept"] == "image/*" and "hidden" in picker
    assert "hidden" in controls.by_id["attached"][1]
    script = read_asset("chat.js").decode()
    assert '$("attach").hidden = !takesImages' in script
    assert client.get("/v1/models").json()["data"][0]["input_modalities"] == ["text"]


@pytest.mark.skipif(NODE is None, reason="no node to run the page's script")
def test_the_page_builds_openai_image_parts_with_data_urls(client):
    """chat.js itself (in Node): a turn with images is image_url parts with the data: URLs, then the text; a turn
    without is a plain string; the request body carries the conversation as built."""
    card = client.get("/v1/models").json()["data"][0]
    url = "data:image/png;base64,iVBORw0KGgo="
    out = run_chat_js("""
        model = INPUT.card.id;
        history.push(userMessage("what is this?", [INPUT.url, INPUT.url]));
        history.push({role: "assistant", content: "a cat"});
        history.push(userMessage("and now?", []));
        const vision = {...INPUT.card, input_modalities: ["text", "image"]};
        return {text: readsImages(INPUT.card), vision: readsImages(vision), body: requestBody(),
                shown: messageText(history[0]), alone: userMessage("", [INPUT.url])};
    """, {"card": card, "url": url})
    assert out["text"] is False and out["vision"] is True
    image = {"type": "image_url", "image_url": {"url": url}}
    assert out["body"]["messages"] == [
        {"role": "user", "content": [image, image, {"type": "text", "text": "what is this?"}]},
        {"role": "assistant", "content": "a cat"}, {"role": "user", "content": "and now?"}]
    assert out["body"]["model"] == "fake-model" and out["body"]["stream"] is True
    assert out["shown"] == "what is this?"
    assert out["alone"] == {"role": "user", "content": [image]}  # an image may be sent without text
