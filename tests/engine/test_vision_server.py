"""`kiln serve` on the tiny LLaVA engine: an image sent through the official openai client as a data URL
content part; the same image twice encoded once (/metrics); bad images refused with a 400 naming the problem;
file:// URLs read inside --allowed-media-path only."""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest
from chat_page_js import NODE, run_chat_js
from vision_fixtures import sample_images

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from server_process import Server  # noqa: E402


def data_url(image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(url: str, text: str = "what is this?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    """The directory the LLaVA server allows (--allowed-media-path) with one picture, and a picture outside it."""
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "outside").mkdir()
    sample_images()["rgb-landscape"].save(root / "allowed" / "landscape.png")
    sample_images()["gray"].save(root / "outside" / "gray.png")
    (root / "allowed" / "link.png").symlink_to(root / "outside" / "gray.png")
    return root


@pytest.fixture(scope="module")
def server(tiny_llava_engine, tmp_path_factory, media_dir):
    srv = Server(tiny_llava_engine, tmp_path_factory.mktemp("serve-llava") / "server.log", "--num-threads", "1",
                 "--served-model-name", "llava", "--allowed-media-path", str(media_dir / "allowed"))
    yield srv
    assert srv.stop() == 0


def test_an_image_through_the_openai_client_encoded_once(server):
    client = server.client()
    url = data_url(sample_images()["rgb-portrait"])
    answers = []
    for _ in range(2):
        done = client.chat.completions.create(model="llava", messages=image_message(url), max_tokens=6,
                                              temperature=0, extra_body={"ignore_eos": True})
        answers.append(done.choices[0].message.content)
        assert done.usage.completion_tokens == 6 and done.usage.prompt_tokens > 16  # the image's 16 tokens
    assert answers[0] == answers[1]
    assert server.metric("kiln_images_encoded_total") == 1
    assert server.metric("kiln_image_cache_hits_total") == 1
    other = client.chat.completions.create(model="llava", messages=image_message(data_url(
        sample_images()["gray"], "JPEG")), max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert other.choices[0].finish_reason == "length"
    assert server.metric("kiln_images_encoded_total") == 2


@pytest.mark.parametrize(("url", "problem"), [
    ("https://example.com/cat.png", "it fetches nothing"),
    ("/home/user/cat.png", "not as a local path"),
    ("data:image/png;base64,%%%", "corrupt base64"),
    ("data:image/png;base64,aGVsbG8gd29ybGQ=", "not a readable image"),
])
def test_bad_images_get_a_400_naming_the_problem(server, url, problem):
    with pytest.raises(openai.BadRequestError, match=problem) as err:
        server.client().chat.completions.create(model="llava", messages=image_message(url), max_tokens=2)
    assert err.value.body["param"] == "messages.0.content.0.image_url.url"


def test_a_file_url_inside_the_allowed_directory_is_the_same_image(server, media_dir):
    """file:///.../landscape.png answers as the same picture sent inline does, and hits its encoder cache."""
    def answer(url: str) -> str:
        done = server.client().chat.completions.create(model="llava", messages=image_message(url), max_tokens=5,
                                                       temperature=0, extra_body={"ignore_eos": True})
        return str(done.choices[0].message.content)

    encoded = server.metric("kiln_images_encoded_total")
    from_file = answer((media_dir / "allowed" / "landscape.png").as_uri())
    assert server.metric("kiln_images_encoded_total") == encoded + 1
    assert answer(data_url(sample_images()["rgb-landscape"])) == from_file
    assert server.metric("kiln_images_encoded_total") == encoded + 1  # the same pixels: a cache hit


@pytest.mark.parametrize(("where", "problem"), [
    ("allowed/../outside/gray.png", "outside the allowed media directory"),
    ("outside/gray.png", "outside the allowed media directory"),
    ("allowed/link.png", "outside the allowed media directory"),  # a symlink in the directory, leading out
    ("allowed/none.png", "no such file"),
])
def test_file_urls_outside_the_allowed_directory_get_a_400(server, media_dir, where, problem):
    with pytest.raises(openai.BadRequestError, match=problem) as err:
        server.client().chat.completions.create(model="llava", max_tokens=2,
                                                messages=image_message(f"file://{media_dir}/{where}"))
    assert err.value.body["param"] == "messages.0.content.0.image_url.url"


@pytest.mark.skipif(NODE is None, reason="no node to run the chat page's script")
def test_the_chat_pages_image_request_is_answered_as_the_clients(server):
    """The model card says the engine reads images (the page's image button shows); the body chat.js builds for a
    turn with an attached image streams the answer the openai client gets for the same message."""
    card = httpx.get(server.url + "/v1/models", headers=server.headers).json()["data"][0]
    assert card["input_modalities"] == ["text", "image"]
    url = data_url(sample_images()["rgba"])
    body = run_chat_js("""
        model = INPUT.card.id;
        for (const [id, value] of [["temperature", "0"], ["max-tokens", "5"]]) $(id).value = value;
        history.push(userMessage("what is this?", [INPUT.url]));
        return requestBody();
    """, {"card": card, "url": url})
    text = ""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers,
                      timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    expected = server.client().chat.completions.create(model="llava", messages=image_message(url), max_tokens=5,
                                                       temperature=0)
    assert text == expected.choices[0].message.content and text


def test_too_many_images_and_unpaired_placeholders_are_refused(server):
    url = data_url(sample_images()["rgb-tiny"])
    content = [{"type": "image_url", "image_url": {"url": url}}] * 9
    with pytest.raises(openai.BadRequestError, match="at most 8"):
        server.client().chat.completions.create(model="llava", messages=[{"role": "user", "content": content}],
                                                max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="1 image placeholder"):
        server.client().chat.completions.create(model="llava", max_tokens=2,
                                                messages=[{"role": "user", "content": "look: <image>"}])


@pytest.fixture(scope="module")
def smolvlm_server(tiny_smolvlm_engine, tmp_path_factory):
    srv = Server(tiny_smolvlm_engine, tmp_path_factory.mktemp("serve-smolvlm") / "server.log", "--num-threads", "1",
                 "--served-model-name", "smolvlm")
    yield srv
    assert srv.stop() == 0


def test_smolvlm_takes_an_image_url_and_answers_as_the_offline_engine(smolvlm_server, tiny_smolvlm_engine):
    """A split image (1 x 4 tiles + the global one) through /v1/chat/completions: the prompt is the tiles' layout
    (5 runs of 4 image tokens among tile markers) and the answer is the offline engine's for the same message."""
    from kiln.runtime import LLM, RuntimeConfig, SamplingParams

    image = sample_images()["rgb-landscape"]
    messages = image_message(data_url(image), "What is in this picture?")
    done = smolvlm_server.client().chat.completions.create(
        model="smolvlm", messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    offline = LLM(tiny_smolvlm_engine, RuntimeConfig(kv_cache_bytes=4 << 20)).chat(
        messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert done.usage.prompt_tokens == len(offline.prompt_token_ids) > 5 * 6
    assert done.choices[0].message.content == offline.outputs[0].text
    assert smolvlm_server.metric("kiln_images_encoded_total") == 1


@pytest.fixture(scope="module")
def llava_next_server(tiny_llava_next_engine, tmp_path_factory):
    srv = Server(tiny_llava_next_engine, tmp_path_factory.mktemp("serve-llava-next") / "server.log", "--num-threads",
                 "1", "--served-model-name", "llava-next")
    yield srv
    assert srv.stop() == 0


def test_llava_next_takes_an_image_url_and_answers_as_the_offline_engine(llava_next_server, tiny_llava_next_engine):
    """An any-resolution image (a 3 x 1 grid and the base tile) through /v1/chat/completions: the prompt holds its
    packed run (16 base rows, 10 unpadded map rows of 4 plus a newline each) and the answer is the offline
    engine's for the same message."""
    from kiln.runtime import LLM, RuntimeConfig, SamplingParams

    messages = image_message(data_url(sample_images()["rgb-portrait"]), "What is shown in this image?")
    done = llava_next_server.client().chat.completions.create(
        model="llava-next", messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    offline = LLM(tiny_llava_next_engine, RuntimeConfig(kv_cache_bytes=4 << 20)).chat(
        messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert offline.prompt_token_ids.count(261) == 16 + 10 * 5
    assert done.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert done.choices[0].message.content == offline.outputs[0].text
    assert llava_next_server.metric("kiln_images_encoded_total") == 1


def test_a_server_without_an_allowed_media_path_reads_no_file(smolvlm_server, media_dir):
    with pytest.raises(openai.BadRequestError, match="reading local files is off.*--allowed-media-path"):
        smolvlm_server.client().chat.completions.create(
            model="smolvlm", max_tokens=2, messages=image_message((media_dir / "allowed" / "landscape.png").as_uri()))
