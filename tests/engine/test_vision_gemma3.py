"""A tiny random Gemma 3 vision-language model (tests/gemma3_vision_fixtures.py: gemma-3-4b-it's config shrunk)
built into an engine and held to transformers: the prompt layout against Gemma3Processor's token ids, the encoder
graph's embeddings against get_image_features, the text graph's logits over an image + text prompt (one step, and
chunks that keep the image run whole), greedy tokens through the scheduler with a small step budget, and what
the bidirectional image attention is for: attending causally over the image tokens moves the logits away."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_driver import PagedDriver
from gemma3_vision_fixtures import BOI_ID, IMAGE_ID, IMAGE_SIZE, TEXT_HIDDEN, TOKENS_PER_IMAGE, hf_processor
from vision_fixtures import sample_images

from kiln.contract import ATTEND_UNTIL
from kiln.manifest import read_manifest
from kiln.runtime import LLM, RuntimeConfig, SamplingParams
from kiln.runtime.vision.encoder import ImageEncoder
from kiln.runtime.vision.prompt import attend_until, image_rows

torch = pytest.importorskip("torch")
TEXT = "<|im_start|><start_of_turn>user\n<start_of_image>What is in this picture?<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def hf_model(tiny_gemma3_vlm_dir):
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(tiny_gemma3_vlm_dir, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def processor(tiny_gemma3_vlm_dir):
    return hf_processor(tiny_gemma3_vlm_dir)


@pytest.fixture(scope="module")
def llm(tiny_gemma3_vlm_engine):
    return LLM(tiny_gemma3_vlm_engine, RuntimeConfig(kv_cache_bytes=8 << 20))


def hf_inputs(processor, image, text: str = TEXT) -> dict:
    out = processor(text=[text], images=[[image]], return_tensors="pt")
    return {"input_ids": out["input_ids"], "pixel_values": out["pixel_values"].float(),
            "token_type_ids": out["token_type_ids"], "attention_mask": out["attention_mask"]}


def test_manifest_and_graph(tiny_gemma3_vlm_engine):
    vision = read_manifest(tiny_gemma3_vlm_engine).vision
    assert vision is not None and vision.family == "gemma3"
    assert (vision.image_token_id, vision.tokens_per_image, vision.image_size) == (BOI_ID, TOKENS_PER_IMAGE, IMAGE_SIZE)
    assert ATTEND_UNTIL in read_manifest(tiny_gemma3_vlm_engine).graph_inputs


def test_encoder_embeddings_equal_transformers(tiny_gemma3_vlm_engine, hf_model, processor):
    encoder = ImageEncoder(tiny_gemma3_vlm_engine, read_manifest(tiny_gemma3_vlm_engine).vision)
    pixels = torch.cat([hf_inputs(processor, sample_images()[n])["pixel_values"] for n in ("rgb-portrait", "cmyk")])
    ours = encoder.run(pixels.numpy())
    with torch.no_grad():
        theirs = hf_model.model.get_image_features(pixels).pooler_output.numpy()
    assert ours.shape == (2, TOKENS_PER_IMAGE, TEXT_HIDDEN)
    np.testing.assert_allclose(ours, theirs.reshape(ours.shape), rtol=0, atol=1e-4)


@pytest.mark.parametrize("text", [TEXT, "<|im_start|>look:<start_of_image>and<start_of_image>\n"])
def test_the_prompt_is_the_processors(llm, processor, text):
    """Text prompts expand as Gemma3Processor expands them (in text: the layout's newlines merge with the
    prompt's), with one bidirectional run per image."""
    images = [sample_images()[n] for n in ("rgb-landscape", "gray")[:text.count("<start_of_image>")]]
    request = llm.engine.prepare("r", text, SamplingParams(max_tokens=1), images=images)
    theirs = processor(text=[text], images=[images], return_tensors="np")
    assert list(request.prompt_token_ids) == theirs["input_ids"][0].tolist()
    runs = [p for s in request.images for p in range(s.start, s.end)]
    assert runs == np.flatnonzero(theirs["token_type_ids"][0]).tolist()
    assert all(span.bidirectional for span in request.images)


def test_token_id_prompts_get_the_layout_on_ids(llm):
    ids = llm.tokenizer.encode("<|im_start|>hi <start_of_image> there")
    request = llm.engine.prepare("r", ids, SamplingParams(max_tokens=1), images=[sample_images()["rgb-tiny"]])
    expanded = list(request.prompt_token_ids)
    start = request.images[0].start
    assert expanded[start - 1] == BOI_ID and expanded[start:start + TOKENS_PER_IMAGE] == [IMAGE_ID] * TOKENS_PER_IMAGE
    assert llm.tokenizer.decode(expanded, skip_special_tokens=False) == llm.tokenizer.decode(
        llm.tokenizer.encode(llm.engine.image_encoder.gemma3_prompt(llm.tokenizer).expand_text(
            "<|im_start|>hi <start_of_image> there")), skip_special_tokens=False)


def engine_prompt(llm, image) -> tuple[list[int], tuple]:
    request = llm.engine.prepare("r", TEXT, SamplingParams(max_tokens=1), images=[image])
    return list(request.prompt_token_ids), request.images


def whole_run_chunks(length: int, size: int, spans: tuple) -> list[tuple[int, int]]:
    """Chunks of `size` tokens whose edges inside an image run move to the run's end (as the scheduler keeps a
    run in one step)."""
    edges = [e for e in range(size, length, size) if not any(s.start < e < s.end for s in spans)]
    bounds = [0, *edges, length]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def engine_logits(engine_dir, ids: list[int], spans: tuple, chunk: int | None, bidirectional: bool = True):
    driver = PagedDriver(engine_dir / "model.onnx", 16)
    rows = []
    for start, end in whole_run_chunks(len(ids), chunk or len(ids), spans):
        batch = driver._pack([(0, ids[start:end])], all_rows=True)
        parts = image_rows(spans, start, end - start, 0)
        if parts:
            until = attend_until(spans, start, end - start) if bidirectional else None
            batch = dataclasses.replace(batch, image_rows=np.concatenate([p[0] for p in parts]),
                                        image_embeds=np.concatenate([p[1] for p in parts]), attend_until=until)
        rows.append(driver.runner.execute(batch))
    return np.concatenate(rows)


@pytest.mark.parametrize("chunk", [None, 7])
def test_logits_equal_transformers(tiny_gemma3_vlm_engine, llm, hf_model, processor, chunk):
    """In one step, or in chunks of 7 (the one holding the image run grown to its end)."""
    image = sample_images()["rgb-portrait"]
    inputs = hf_inputs(processor, image)
    ids, spans = engine_prompt(llm, image)
    assert ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        theirs = hf_model(**inputs).logits[0].numpy()
    np.testing.assert_allclose(engine_logits(tiny_gemma3_vlm_engine, ids, spans, chunk), theirs, rtol=0, atol=1e-3)


def test_causal_image_attention_or_misplaced_rows_do_not_match(tiny_gemma3_vlm_engine, llm, hf_model, processor):
    """What the comparison above checks: the image tokens attending causally only (attend_until left out), the
    image rows scaled like token embeddings, or no image rows, are all far from transformers."""
    image = sample_images()["rgb-portrait"]
    ids, spans = engine_prompt(llm, image)
    with torch.no_grad():
        theirs = hf_model(**hf_inputs(processor, image)).logits[0].numpy()
    after = spans[0].end  # the text after the image sees the image's K/V
    causal = engine_logits(tiny_gemma3_vlm_engine, ids, spans, None, bidirectional=False)
    assert np.abs(causal[after:] - theirs[after:]).max() > 1e-2
    np.testing.assert_allclose(causal[:spans[0].start], theirs[:spans[0].start], rtol=0, atol=1e-3)  # before it
    scaled = tuple(dataclasses.replace(s, embeddings=s.embeddings * np.float32(TEXT_HIDDEN**0.5)) for s in spans)
    for wrong in (scaled, ()):
        assert np.abs(engine_logits(tiny_gemma3_vlm_engine, ids, wrong, None) - theirs).max() > 0.1


def test_a_chunk_cutting_an_image_run_is_refused(llm):
    _, spans = engine_prompt(llm, sample_images()["gray"])
    with pytest.raises(ValueError, match="cuts the bidirectional image run"):
        attend_until(spans, 0, spans[0].start + 3)


def hf_greedy(hf_model, inputs: dict, new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize(("name", "max_num_tokens"), [("rgb-landscape", None), ("palette", 20)])
def test_greedy_tokens_equal_transformers(tiny_gemma3_vlm_engine, hf_model, processor, name, max_num_tokens):
    """max_num_tokens 20: the scheduler's chunks stop before the 16-token run and take it whole in the next step."""
    image = sample_images()[name]
    llm = LLM(tiny_gemma3_vlm_engine, RuntimeConfig(max_num_tokens=max_num_tokens, kv_cache_bytes=8 << 20))
    inputs = hf_inputs(processor, image)
    out = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), images=[[image]])[0]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(out.outputs[0].token_ids) == hf_greedy(hf_model, inputs, 8)


def test_an_image_longer_than_the_step_budget_is_refused(tiny_gemma3_vlm_engine):
    from kiln.errors import InvalidParamError

    llm = LLM(tiny_gemma3_vlm_engine, RuntimeConfig(max_num_tokens=TOKENS_PER_IMAGE - 1, kv_cache_bytes=8 << 20))
    with pytest.raises(InvalidParamError, match="more than the engine's max_num_tokens"):
        llm.generate(TEXT, SamplingParams(max_tokens=1), images=[[sample_images()["gray"]]])


def test_chat_with_an_image_part(llm, hf_model, processor):
    """An image part becomes Gemma 3's inline "<start_of_image>" and the prompt is the processor's."""
    image = sample_images()["rgba"]
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "What is in this picture?"}]}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    inputs = hf_inputs(processor, image)
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(out.outputs[0].token_ids) == hf_greedy(hf_model, inputs, 5)
