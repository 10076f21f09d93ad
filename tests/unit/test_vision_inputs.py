"""The image side's pure pieces: the manifest's vision object, placeholder expansion and the block keys it gives
prefix caching, and image decoding's refusals (each names its problem)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json

import numpy as np
import pytest

from kiln.errors import InvalidParamError
from kiln.manifest import BuildOptions, EngineLoadError, Manifest, read_manifest, write_manifest
from kiln.runtime.vision import images as image_limits
from kiln.runtime.vision.chat import split_images
from kiln.runtime.vision.images import decode_image_url
from kiln.runtime.vision.prompt import block_image_keys, expand_image_tokens, image_rows
from kiln.vision import VisionSpec

SPEC = VisionSpec(family="llava", image_token_id=9, tokens_per_image=4, embedding_size=3, image_size=56)


def png_url(size=(5, 4), mode="RGB") -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def make_manifest() -> Manifest:
    from test_manifest import SPEC as MODEL_SPEC

    return Manifest(spec=MODEL_SPEC, build=BuildOptions(max_seq_len=512), backend="onnxruntime-cpu",
                    graph_inputs=("input_ids",), graph_outputs=("logits",))


def test_vision_spec_round_trips_through_the_manifest(tmp_path):
    manifest = dataclasses.replace(make_manifest(), vision=SPEC)
    write_manifest(tmp_path, manifest)
    assert read_manifest(tmp_path).vision == SPEC
    text_only = write_manifest(tmp_path, make_manifest())
    assert "vision" not in json.loads(text_only.to_json())  # a text engine's manifest is as before


def test_a_bad_vision_object_is_named():
    with pytest.raises(ValueError, match="tokens_per_image"):
        dataclasses.replace(SPEC, tokens_per_image=0)
    with pytest.raises(ValueError, match="family"):
        dataclasses.replace(SPEC, family="qwen2_vl")

    text = dataclasses.replace(make_manifest(), vision=SPEC).to_json().replace('"tokens_per_image": 4',
                                                                               '"tokens_per_image": -4')
    with pytest.raises(EngineLoadError, match="field vision is inconsistent"):
        Manifest.from_json(text)


def test_placeholders_expand_to_each_images_run():
    embeds = [np.ones((4, 3), np.float32), 2 * np.ones((4, 3), np.float32)]
    ids, spans = expand_image_tokens([1, 9, 2, 9, 3], 9, embeds, ["a" * 64, "b" * 64])
    assert ids == [1, 9, 9, 9, 9, 2, 9, 9, 9, 9, 3]
    assert [(s.start, s.end) for s in spans] == [(1, 5), (6, 10)]
    with pytest.raises(InvalidParamError, match="2 image placeholder.*1 image"):
        expand_image_tokens([1, 9, 2, 9], 9, embeds[:1], ["a" * 64])
    # a chunk of positions [3, 8) from packed row 10: the first image's last 2 rows, the second's first 2
    parts = image_rows(spans, 3, 5, 10)
    assert [p[0].tolist() for p in parts] == [[10, 11], [13, 14]]
    assert [p[1][:, 0].tolist() for p in parts] == [[1, 1], [2, 2]]


def test_block_keys_name_the_images_a_block_holds():
    _, first = expand_image_tokens([1, 9], 9, [np.zeros((4, 3), np.float32)], ["a" * 64])
    _, other = expand_image_tokens([1, 9], 9, [np.zeros((4, 3), np.float32)], ["b" * 64])
    assert block_image_keys(first, 0, 4) != block_image_keys(other, 0, 4)
    assert block_image_keys(first, 8, 4) == ()  # past the image: plain text hashing


def test_images_come_out_of_chat_content_parts():
    messages = [{"role": "user", "content": [{"type": "text", "text": "look: "},
                                             {"type": "image_url", "image_url": {"url": png_url()}}]}]
    flat, images = split_images(messages, "<image>\n")
    assert flat == [{"role": "user", "content": "look: <image>\n"}] and images[0].size == (5, 4)
    assert split_images(messages, "<image>")[0] == [{"role": "user", "content": "look: <image>"}]  # SmolVLM's
    with pytest.raises(InvalidParamError, match="not a vision-language engine"):
        split_images(messages, None)
    with pytest.raises(InvalidParamError, match="type 'audio'"):
        split_images([{"role": "user", "content": [{"type": "audio"}]}], "<image>")


@pytest.mark.parametrize(("url", "problem"), [
    ("https://example.com/cat.png", "not 'https' URLs"),
    ("/etc/passwd", "not as a local path"),
    ("file:///etc/passwd", "reading local files is off.*--allowed-media-path"),
    ("data:text/plain;base64,aGVsbG8=", "data:image/<type>;base64"),
    ("data:image/png;base64,@@@", "corrupt base64"),
    ("data:image/png;base64,aGVsbG8=", "not a readable image"),
])
def test_bad_image_urls_are_refused_by_name(url, problem):
    with pytest.raises(InvalidParamError, match=problem):
        decode_image_url(url, "messages[0].content[0].image_url.url")


def test_truncated_too_large_and_too_many_images_are_refused(monkeypatch):
    url = png_url((40, 40))
    raw = base64.b64decode(url.split(",", 1)[1])
    truncated = "data:image/png;base64," + base64.b64encode(raw[: len(raw) // 2]).decode()
    with pytest.raises(InvalidParamError, match="not a readable image"):
        decode_image_url(truncated, "x")
    monkeypatch.setattr(image_limits, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(InvalidParamError, match="40x40"):
        decode_image_url(url, "x")
    monkeypatch.setattr(image_limits, "MAX_IMAGE_BYTES", 10)
    with pytest.raises(InvalidParamError, match="larger than"):
        decode_image_url(url, "x")
    parts = [{"type": "image_url", "image_url": {"url": png_url()}}] * (image_limits.MAX_IMAGES_PER_REQUEST + 1)
    with pytest.raises(InvalidParamError, match="at most"):
        split_images([{"role": "user", "content": parts}], "<image>")


def test_the_server_takes_image_parts_out_of_messages():
    pytest.importorskip("pydantic")
    from kiln.runtime.server.images import take_images
    from kiln.runtime.server.protocol import ChatMessage

    message = ChatMessage.model_validate({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_url()}}, {"type": "text", "text": "what is it?"}]})
    flat, images = take_images([message], "<image>\n")
    assert flat[0].as_dict() == {"role": "user", "content": "<image>\nwhat is it?"} and len(images) == 1
    with pytest.raises(InvalidParamError, match="not a vision-language engine") as err:
        take_images([message], None)
    assert err.value.param == "messages.0.content.0"


@pytest.fixture
def media(tmp_path):
    """An allowed directory holding a PNG, a sub-directory, and a symlink out of it; a PNG beside it, outside."""
    from PIL import Image

    allowed, outside = tmp_path / "media", tmp_path / "private"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    Image.new("RGB", (6, 3), (200, 10, 10)).save(allowed / "sub" / "cat one.png")
    Image.new("RGB", (7, 2)).save(outside / "secret.png")
    (allowed / "escape.png").symlink_to(outside / "secret.png")
    (allowed / "inside-link.png").symlink_to(allowed / "sub" / "cat one.png")
    return allowed.resolve(), outside.resolve()


def test_file_urls_inside_the_allowed_directory_are_read(media):
    allowed, _ = media
    image = decode_image_url(f"file://{allowed}/sub/cat%20one.png", "x", allowed)
    assert image.size == (6, 3) and image.getpixel((0, 0)) == (200, 10, 10)
    assert decode_image_url(f"file://localhost{allowed}/inside-link.png", "x", allowed).size == (6, 3)
    assert decode_image_url(f"file://{allowed}/sub/../sub/cat%20one.png", "x", allowed).size == (6, 3)


@pytest.mark.parametrize(("tail", "problem"), [
    ("/sub/../../private/secret.png", "outside the allowed media directory"),
    ("/escape.png", "outside the allowed media directory"),  # a symlink in the directory pointing out of it
    ("/../private/missing.png", "outside the allowed media directory"),  # not "no such file": nothing leaks
    ("/sub/missing.png", "no such file"),
    ("/sub", "not a regular file"),
    ("/sub/cat%20one.png?x=1", "query or fragment"),
])
def test_file_urls_that_leave_the_directory_or_name_no_file_are_refused(media, tail, problem):
    allowed, _ = media
    with pytest.raises(InvalidParamError, match=problem) as err:
        decode_image_url(f"file://{allowed}{tail}", "messages[0].content[0].image_url.url", allowed)
    assert err.value.param == "messages[0].content[0].image_url.url"
    assert "private/secret" not in str(err.value) or ".." in tail  # where a symlink leads is never told


def test_local_files_need_the_allowed_directory(media, monkeypatch):
    allowed, outside = media
    with pytest.raises(InvalidParamError, match="reading local files is off"):
        decode_image_url(f"file://{allowed}/sub/cat%20one.png", "x", None)
    with pytest.raises(InvalidParamError, match=f"as file://{allowed}/sub/cat one.png"):  # a path: the URL to send
        decode_image_url(f"{allowed}/sub/cat one.png", "x", allowed)
    with pytest.raises(InvalidParamError, match="host 'example.com'"):
        decode_image_url("file://example.com/sub/cat.png", "x", allowed)
    monkeypatch.setattr(image_limits, "MAX_IMAGE_BYTES", 10)
    with pytest.raises(InvalidParamError, match="larger than"):
        decode_image_url(f"file://{allowed}/sub/cat%20one.png", "x", allowed)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{outside}/x.png"}}]}]
    with pytest.raises(InvalidParamError, match="outside the allowed"):
        split_images(messages, "<image>", allowed)


def test_the_allowed_media_path_must_be_a_directory(media):
    from kiln.runtime.params import RuntimeConfig

    allowed, _ = media
    assert RuntimeConfig(allowed_media_path=str(allowed / "sub" / "..")).media_dir() == allowed
    assert RuntimeConfig().media_dir() is None
    with pytest.raises(InvalidParamError, match="allowed_media_path .* is not a directory"):
        RuntimeConfig(allowed_media_path=str(allowed / "sub" / "cat one.png"))
