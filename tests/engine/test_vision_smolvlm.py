"""A tiny random SmolVLM (tests/smolvlm_fixtures.py: SmolVLM-256M-Instruct's config shrunk, the SmolLM2 tokenizer)
built into an engine and held to transformers: the prompt layout against Idefics3Processor's token ids, the encoder
graph's tile embeddings, the text graph's logits over an image + text prompt (one step and chunked prefill across
the tile runs), greedy tokens, and a chat message with an image part."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_driver import PagedDriver
from smolvlm_fixtures import IMAGE_TOKEN_ID, PROCESSOR, TEXT_HIDDEN, TOKENS_PER_TILE, hf_processor
from vision_fixtures import sample_images

from kiln.manifest import read_manifest
from kiln.runtime import LLM, RuntimeConfig, SamplingParams
from kiln.runtime.vision import idefics3
from kiln.runtime.vision.encoder import ImageEncoder
from kiln.runtime.vision.idefics3 import Idefics3ImageConfig
from kiln.runtime.vision.prompt import expand_image_tokens, image_hash, image_rows

torch = pytest.importorskip("torch")
TEXT = "User:<image>What is in this picture?<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def hf_model(tiny_smolvlm_dir):
    from transformers import SmolVLMForConditionalGeneration

    return SmolVLMForConditionalGeneration.from_pretrained(tiny_smolvlm_dir, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def processor(tiny_smolvlm_dir):
    return hf_processor(tiny_smolvlm_dir)


@pytest.fixture(scope="module")
def llm(tiny_smolvlm_engine):
    return LLM(tiny_smolvlm_engine, RuntimeConfig(kv_cache_bytes=8 << 20))


def hf_inputs(processor, image, text: str = TEXT) -> dict:
    out = processor(text=[text], images=[[image]], return_tensors="pt")
    return {"input_ids": out["input_ids"], "pixel_values": out["pixel_values"].float(),
            "pixel_attention_mask": out["pixel_attention_mask"]}


def test_manifest_names_the_family(tiny_smolvlm_engine):
    vision = read_manifest(tiny_smolvlm_engine).vision
    assert vision is not None and vision.family == "idefics3"
    assert (vision.image_token_id, vision.tokens_per_image, vision.image_size) == (IMAGE_TOKEN_ID, 4, 64)


LAYOUT_CONFIG = Idefics3ImageConfig.from_hf(PROCESSOR)


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_smolvlm_dir):
    return tiny_smolvlm_dir


@pytest.fixture(scope="module")
def prompt(tokenizer_dir):
    from kiln.runtime.tokenizer import Tokenizer

    return idefics3.Idefics3Prompt(Tokenizer(tokenizer_dir), IMAGE_TOKEN_ID, TOKENS_PER_TILE)


@pytest.mark.parametrize("names", [("rgb-landscape",), ("rgb-portrait", "gray"), ("rgb-tiny",)])
def test_placeholders_expand_as_the_processor_writes_them(tokenizer_dir, prompt, names):
    from kiln.runtime.tokenizer import Tokenizer

    images = [sample_images()[n] for n in names]
    text = "User:" + "".join(f"<image>look {i}\n" for i in range(len(images))) + "<end_of_utterance>\nAssistant:"
    theirs = hf_processor(tokenizer_dir)(text=[text], images=[images], return_tensors="np")["input_ids"][0]
    ids = Tokenizer(tokenizer_dir).encode(text)
    layouts = [prompt.layout(*idefics3.grid(im.height, im.width, LAYOUT_CONFIG)) for im in images]
    tiles = [idefics3.pixel_values(im, LAYOUT_CONFIG)[0] for im in images]
    embeddings = [np.zeros((len(t) * TOKENS_PER_TILE, 8), np.float32) for t in tiles]
    expanded, spans = expand_image_tokens(ids, IMAGE_TOKEN_ID, embeddings, [str(i) * 64 for i in range(len(images))],
                                          layouts)
    assert expanded == theirs.tolist()
    image_positions = [i for i, t in enumerate(expanded) if t == IMAGE_TOKEN_ID]
    assert [p for s in spans for p in range(s.start, s.end)] == image_positions
    assert len(spans) == sum(len(t) for t in tiles)  # one run per tile


def test_a_single_tile_layout_matches(tokenizer_dir, prompt):
    from kiln.runtime.tokenizer import Tokenizer

    image, text = sample_images()["gray"], "User:<image>hi"
    hf = hf_processor(tokenizer_dir)
    hf.image_processor.do_image_splitting = False
    theirs = hf(text=[text], images=[[image]], return_tensors="np")["input_ids"][0].tolist()
    layout = prompt.layout(*idefics3.grid(image.height, image.width,
                                          dataclasses.replace(LAYOUT_CONFIG, do_image_splitting=False)))
    assert len(layout.runs) == 1 and layout.token_ids[:2] == (prompt.fake, prompt.global_image)
    embeddings = [np.zeros((TOKENS_PER_TILE, 8), np.float32)]
    expanded, _ = expand_image_tokens(Tokenizer(tokenizer_dir).encode(text), IMAGE_TOKEN_ID, embeddings, ["0" * 64],
                                      [layout])
    assert expanded == theirs


def test_encoder_embeddings_equal_transformers(tiny_smolvlm_engine, hf_model, processor):
    """Every tile of a split image (rows x cols + the global one) through the encoder graph."""
    encoder = ImageEncoder(tiny_smolvlm_engine, read_manifest(tiny_smolvlm_engine).vision)
    inputs = hf_inputs(processor, sample_images()["rgb-portrait"])
    ours = encoder.run(inputs["pixel_values"][0].numpy())
    with torch.no_grad():
        theirs = hf_model.model.get_image_features(inputs["pixel_values"],
                                                   inputs["pixel_attention_mask"]).pooler_output[0].numpy()
    assert ours.shape == (9, TOKENS_PER_TILE, TEXT_HIDDEN)
    np.testing.assert_allclose(ours.reshape(theirs.shape), theirs, rtol=0, atol=1e-4)


def engine_prompt(llm, image) -> tuple[list[int], tuple]:
    encoder = llm.engine.image_encoder
    ids = llm.tokenizer.encode(TEXT)
    digest = image_hash(image)
    return expand_image_tokens(ids, IMAGE_TOKEN_ID, encoder.encode([image], [digest]), [digest],
                               encoder.layouts([image], llm.tokenizer))


def engine_logits(engine_dir, ids: list[int], spans: tuple, chunk: int | None) -> np.ndarray:
    driver = PagedDriver(engine_dir / "model.onnx", 16)
    size = chunk or len(ids)
    rows = []
    for start in range(0, len(ids), size):
        batch = driver._pack([(0, ids[start:start + size])], all_rows=True)
        parts = image_rows(spans, start, len(ids[start:start + size]), 0)
        if parts:
            batch = dataclasses.replace(batch, image_rows=np.concatenate([p[0] for p in parts]),
                                        image_embeds=np.concatenate([p[1] for p in parts]))
        rows.append(driver.runner.execute(batch))
    return np.concatenate(rows)


@pytest.mark.parametrize("chunk", [None, 7])
def test_logits_equal_transformers(tiny_smolvlm_engine, llm, hf_model, processor, chunk):
    """The prompt laid out by the engine is the processor's, token for token; its logits are transformers'
    (in one step, or in chunks of 7 whose edges cut the tile runs)."""
    image = sample_images()["rgb-landscape"]
    inputs = hf_inputs(processor, image)
    ids, spans = engine_prompt(llm, image)
    assert ids == inputs["input_ids"][0].tolist() and len(spans) == 5  # 1 x 4 tiles + the global image
    with torch.no_grad():
        theirs = hf_model(**inputs).logits[0].numpy()
    np.testing.assert_allclose(engine_logits(tiny_smolvlm_engine, ids, spans, chunk), theirs, rtol=0, atol=1e-3)


def test_misplaced_tile_embeddings_change_the_logits(tiny_smolvlm_engine, llm, hf_model, processor):
    """What the comparison above checks: the tiles' embeddings in another order, or none, are far off."""
    image = sample_images()["rgb-landscape"]
    ids, spans = engine_prompt(llm, image)
    with torch.no_grad():
        theirs = hf_model(**hf_inputs(processor, image)).logits[0].numpy()
    rotated = tuple(dataclasses.replace(s, embeddings=spans[i - 1].embeddings) for i, s in enumerate(spans))
    for wrong in (rotated, ()):
        assert np.abs(engine_logits(tiny_smolvlm_engine, ids, wrong, None) - theirs).max() > 0.1


def hf_greedy(hf_model, inputs: dict, new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                pad_token_id=2)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize(("name", "max_num_tokens"), [("rgb-portrait", None), ("cmyk", 16)])
def test_greedy_tokens_equal_transformers(tiny_smolvlm_engine, hf_model, processor, name, max_num_tokens):
    image = sample_images()[name]
    llm = LLM(tiny_smolvlm_engine, RuntimeConfig(max_num_tokens=max_num_tokens, kv_cache_bytes=8 << 20))
    inputs = hf_inputs(processor, image)
    out = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), images=[[image]])[0]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(out.outputs[0].token_ids) == hf_greedy(hf_model, inputs, 10)


def test_chat_with_an_image_part(llm, hf_model, processor):
    """An image_url part becomes SmolVLM's inline "<image>" and the prompt is the processor's."""
    import base64
    import io

    image = sample_images()["rgba"]
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is in this picture?"}]}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    inputs = hf_inputs(processor, image, "<|im_start|>" + TEXT)  # what SmolVLM's own chat template renders
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(out.outputs[0].token_ids) == hf_greedy(hf_model, inputs, 6)


def test_an_idefics3_checkpoint_exports_the_same_encoder(tmp_path):
    """Idefics3ForConditionalGeneration (SmolVLM's parent: the same tower, connector and weight names) read by
    load_vision; its encoder graph equals transformers' get_image_features."""
    import json

    import onnx_ir as ir
    import onnxruntime as ort
    from smolvlm_fixtures import PROCESSOR, tiny_smolvlm_config
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    from kiln.export.vision.export_encoder import export_encoder, load_vision_of

    small = tiny_smolvlm_config().to_dict()
    config = Idefics3Config(text_config=small["text_config"], scale_factor=small["scale_factor"],
                            image_token_id=IMAGE_TOKEN_ID,
                            vision_config={**small["vision_config"], "model_type": "idefics3_vision"})
    config.architectures = ["Idefics3ForConditionalGeneration"]
    torch.manual_seed(3)
    model = Idefics3ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PROCESSOR,
                                                                   "image_processor_type": "Idefics3ImageProcessor"}))
    source = load_vision_of(tmp_path)
    assert source is not None and source.spec.family == "idefics3" and source.spec.tokens_per_image == TOKENS_PER_TILE
    ir.save(export_encoder(source), tmp_path / "vision.onnx")
    pixels = torch.randn(3, 3, 64, 64)
    ours = ort.InferenceSession(str(tmp_path / "vision.onnx")).run(None, {"pixel_values": pixels.numpy()})[0]
    with torch.no_grad():
        theirs = model.model.get_image_features(pixels[None]).pooler_output[0].numpy()
    np.testing.assert_allclose(ours.reshape(theirs.shape), theirs, rtol=0, atol=1e-4)
    mismatched = {**PROCESSOR, "max_image_size": {"longest_edge": 32}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(mismatched))
    with pytest.raises(ValueError, match="max_image_size 32 is not the vision tower's image_size 64"):
        load_vision_of(tmp_path)


def test_kiln_generate_puts_the_image_inline(tiny_smolvlm_engine, llm, tmp_path):
    """`kiln generate --chat --image` writes SmolVLM's placeholder (no newline after it) and answers as LLM.chat."""
    from click.testing import CliRunner

    from kiln.cli import main

    image = sample_images()["palette"]
    image.save(tmp_path / "cat.png")
    result = CliRunner().invoke(main, ["generate", str(tiny_smolvlm_engine), "--chat", "the", "--image",
                                       str(tmp_path / "cat.png"), "--max-tokens", "5"])
    assert result.exit_code == 0, result.output
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "the"}]}]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5))[0]
    start = llm.tokenizer.decode(expected.prompt_token_ids[:4], skip_special_tokens=False)
    assert start == "<|im_start|>User:<fake_token_around_image>"
    assert result.output == expected.outputs[0].text + "\n"
