"""A tiny random LLaVA-1.5 (tests/vision_fixtures.py) built into an engine and held to transformers'
LlavaForConditionalGeneration: the encoder graph's embeddings, the text graph's logits over an image + text
prompt (one step and chunked prefill across the image run), greedy tokens, and prefix caching keyed by the
image's content."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from engine_driver import PagedDriver
from vision_fixtures import IMAGE_TOKEN, NUM_IMAGE_TOKENS, sample_images

from kiln.manifest import EngineLoadError, read_manifest
from kiln.runtime import LLM, RuntimeConfig, SamplingParams
from kiln.runtime.vision.encoder import ImageEncoder
from kiln.runtime.vision.prompt import image_rows
from kiln.vision import IMAGE_ROWS

torch = pytest.importorskip("torch")
IMAGE_TOKEN_ID = 261
# bos, three text tokens, the image run, five text tokens: the run straddles block 0 / block 1 (block size 16)
PREFIX, SUFFIX = [1, 40, 50, 60], [70, 80, 90, 100, 110]


@pytest.fixture(scope="module")
def llava_dir(tiny_llava_dir):
    return tiny_llava_dir


@pytest.fixture(scope="module")
def llava_engine(tiny_llava_engine):
    return tiny_llava_engine


@pytest.fixture(scope="module")
def hf_model(llava_dir):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(llava_dir, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def encoder(llava_engine):
    return ImageEncoder(llava_engine, read_manifest(llava_engine).vision)


def expanded_prompt() -> list[int]:
    return PREFIX + [IMAGE_TOKEN_ID] * NUM_IMAGE_TOKENS + SUFFIX


def hf_logits(hf_model, encoder, image) -> np.ndarray:
    pixels = torch.from_numpy(encoder.pixel_values([image]))
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor([expanded_prompt()]), pixel_values=pixels).logits[0].numpy()


def test_manifest_lists_and_checksums_the_vision_files(llava_engine):
    manifest = read_manifest(llava_engine)
    assert manifest.vision is not None and manifest.vision.tokens_per_image == NUM_IMAGE_TOKENS
    assert manifest.vision.image_token_id == IMAGE_TOKEN_ID
    for name in ("vision.onnx", "vision.onnx.data", "preprocessor_config.json"):
        assert name in manifest.files
    assert IMAGE_ROWS in manifest.graph_inputs
    assert json.loads((llava_engine / "manifest.json").read_text())["vision"]["family"] == "llava"


def test_a_corrupted_encoder_is_refused_at_load(llava_engine, tmp_path):
    import shutil

    copy = tmp_path / "engine"
    shutil.copytree(llava_engine, copy)
    with open(copy / "vision.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(EngineLoadError, match="vision.onnx is corrupted"):
        read_manifest(copy)


def test_encoder_embeddings_equal_transformers(llava_engine, encoder, hf_model):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    processor = CLIPImageProcessorPil(**json.loads((llava_engine / "preprocessor_config.json").read_text()))
    images = [sample_images()[name] for name in ("rgb-portrait", "gray", "rgba")]
    pixels = processor(images, return_tensors="np")["pixel_values"]
    ours = encoder.run(pixels.astype(np.float32))
    with torch.no_grad():
        theirs = hf_model.model.get_image_features(torch.from_numpy(pixels), vision_feature_layer=-2,
                                                   vision_feature_select_strategy="default").pooler_output
    theirs = torch.stack(list(theirs)).numpy()
    assert ours.shape == (3, NUM_IMAGE_TOKENS, 64)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("chunk", [None, 5, 16])
def test_text_graph_logits_equal_transformers(llava_engine, encoder, hf_model, chunk):
    """The whole prompt in one step, or in chunks of 5 / 16 tokens whose edges fall inside the image run."""
    image = sample_images()["rgb-landscape"]
    embedding = encoder.encode([image])[0]
    from kiln.runtime.vision.prompt import ImageSpan

    spans = (ImageSpan(len(PREFIX), embedding, 1),)
    ids = expanded_prompt()
    driver = PagedDriver(llava_engine / "model.onnx", 16)
    size = chunk or len(ids)
    rows = []
    for start in range(0, len(ids), size):
        batch = driver._pack([(0, ids[start:start + size])], all_rows=True)
        parts = image_rows(spans, start, len(ids[start:start + size]), 0)
        if parts:
            batch = dataclasses.replace(batch, image_rows=np.concatenate([p[0] for p in parts]),
                                        image_embeds=np.concatenate([p[1] for p in parts]))
        rows.append(driver.runner.execute(batch))
    ours = np.concatenate(rows)
    np.testing.assert_allclose(ours, hf_logits(hf_model, encoder, image), rtol=0, atol=1e-3)


def test_without_the_image_embeddings_the_logits_differ(llava_engine, encoder, hf_model):
    """The image rows are what the comparison above checks: the placeholder's own embedding is far off."""
    image = sample_images()["rgb-landscape"]
    driver = PagedDriver(llava_engine / "model.onnx", 16)
    ours = driver.runner.execute(driver._pack([(0, expanded_prompt())], all_rows=True))
    assert np.abs(ours - hf_logits(hf_model, encoder, image))[len(PREFIX):].max() > 0.1


def hf_greedy(hf_model, encoder, image, prompt_ids: list[int], new_tokens: int) -> list[int]:
    pixels = torch.from_numpy(encoder.pixel_values([image]))
    with torch.no_grad():
        out = hf_model.generate(input_ids=torch.tensor([prompt_ids]), pixel_values=pixels,
                                max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("max_num_tokens", [None, 7])
def test_greedy_tokens_equal_transformers(llava_engine, encoder, hf_model, max_num_tokens):
    image = sample_images()["rgb-portrait"]
    llm = LLM(llava_engine, RuntimeConfig(max_num_tokens=max_num_tokens, kv_cache_bytes=4 << 20))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = PREFIX + [IMAGE_TOKEN_ID] + SUFFIX  # one placeholder: the engine expands it
    ours = llm.generate(prompt, params, images=[[image]])[0]
    assert ours.prompt_token_ids == expanded_prompt()
    assert list(ours.outputs[0].token_ids) == hf_greedy(hf_model, encoder, image, expanded_prompt(), 12)


def test_prefix_cache_is_keyed_by_the_image(llava_engine, encoder, hf_model):
    """The same text with another image misses the cache (and answers for its own image); the same image again
    hits it and the encoder does not run again."""
    llm = LLM(llava_engine, RuntimeConfig(kv_cache_bytes=4 << 20))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = PREFIX + [IMAGE_TOKEN_ID] + SUFFIX + [120] * 16  # blocks 0, 1 and 2 full: cacheable
    first, second = sample_images()["rgb-portrait"], sample_images()["palette"]
    encoder_runs = llm.engine.image_encoder
    llm.generate(prompt, params, images=[[first]])
    other = llm.generate(prompt, params, images=[[second]])[0]
    assert other.num_cached_tokens == 0
    full = expanded_prompt() + [120] * 16
    assert list(other.outputs[0].token_ids) == hf_greedy(hf_model, encoder, second, full, 6)
    encoded = encoder_runs.images_encoded
    again = llm.generate(prompt, params, images=[[first]])[0]
    assert again.num_cached_tokens == 32
    assert encoder_runs.images_encoded == encoded  # served from the encoder's cache
    assert list(again.outputs[0].token_ids) == hf_greedy(hf_model, encoder, first, full, 6)
    llm.engine.block_manager.check()


def test_chat_with_an_image_part(llava_engine, encoder, hf_model):
    import base64
    import io

    image = sample_images()["rgb-tiny"]
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    llm = LLM(llava_engine, RuntimeConfig(kv_cache_bytes=4 << 20))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "the"}]}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": f"{IMAGE_TOKEN}\nthe"}])
    ids = llm.tokenizer.encode(text)
    position = ids.index(IMAGE_TOKEN_ID)
    expanded = ids[:position] + [IMAGE_TOKEN_ID] * NUM_IMAGE_TOKENS + ids[position + 1:]
    assert out.prompt_token_ids == expanded
    assert list(out.outputs[0].token_ids) == hf_greedy(hf_model, encoder, image, expanded, 5)


def test_bad_image_requests_name_the_problem(llava_engine):
    from kiln.errors import InvalidParamError

    llm = LLM(llava_engine, RuntimeConfig(kv_cache_bytes=4 << 20))
    image = sample_images()["gray"]
    with pytest.raises(InvalidParamError, match="1 image placeholder.*2 image"):
        llm.generate(PREFIX + [IMAGE_TOKEN_ID], images=[[image, image]])
    with pytest.raises(InvalidParamError, match="1 image placeholder.*0 image"):
        llm.generate(PREFIX + [IMAGE_TOKEN_ID])
    bad_parts = {
        "not a readable image": "data:image/png;base64," + "aGVsbG8=",
        "corrupt base64": "data:image/png;base64,@@@",
        "it fetches nothing": "https://example.com/cat.png",
        "reading local files is off": "file:///etc/hostname",
    }
    for problem, url in bad_parts.items():
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        with pytest.raises(InvalidParamError, match=problem):
            llm.chat(messages)


def test_chat_reads_a_file_url_inside_the_allowed_media_path(llava_engine, tmp_path):
    image = sample_images()["palette"]
    image.save(tmp_path / "pic.png")
    llm = LLM(llava_engine, RuntimeConfig(kv_cache_bytes=4 << 20, allowed_media_path=str(tmp_path)))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def answer(part: dict) -> list[int]:
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "the"}]}]
        return list(llm.chat(messages, params)[0].outputs[0].token_ids)

    from_file = answer({"type": "image_url", "image_url": {"url": (tmp_path / "pic.png").as_uri()}})
    assert from_file == answer({"type": "image", "image": image})
    from kiln.errors import InvalidParamError

    with pytest.raises(InvalidParamError, match="outside the allowed media directory"):
        answer({"type": "image_url", "image_url": {"url": f"file://{tmp_path}/../pic.png"}})


def test_kiln_generate_takes_an_image_file(llava_engine, tmp_path):
    from click.testing import CliRunner

    from kiln.cli import main

    image = sample_images()["rgba"]
    image.save(tmp_path / "cat.png")
    args = ["generate", str(llava_engine), "--chat", "the", "--image", str(tmp_path / "cat.png"), "--max-tokens", "5"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    llm = LLM(llava_engine, RuntimeConfig(kv_cache_bytes=4 << 20))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "the"}]}]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].text
    assert result.output == expected + "\n"
    (tmp_path / "not-an-image.png").write_bytes(b"hello")
    bad = CliRunner().invoke(main, [*args[:5], str(tmp_path / "not-an-image.png")])
    assert bad.exit_code != 0 and "not a readable image" in bad.output


def test_the_encoder_cache_holds_its_byte_budget(llava_engine):
    one_image = NUM_IMAGE_TOKENS * 64 * 4
    encoder = ImageEncoder(llava_engine, read_manifest(llava_engine).vision, cache_bytes=one_image)
    first, second = sample_images()["gray"], sample_images()["cmyk"]
    for image in (first, first, second, first):  # the second evicts the first
        encoder.encode([image])
    assert (encoder.images_encoded, encoder.cache_hits) == (3, 1)
    np.testing.assert_array_equal(encoder.encode([second])[0], encoder.run(encoder.pixel_values([second]))[0])
