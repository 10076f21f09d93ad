"""A tiny random LLaVA-NeXT (tests/llava_next_fixtures.py: llava-v1.6-mistral-7b's config shrunk) built into an
engine and held to transformers' LlavaNextForConditionalGeneration: the encoder graph's tile embeddings and the
packed image features (each packing piece perturbed to show the comparison sees it), the prompt layout against
LlavaNextProcessor's token ids, the text graph's logits over an image + text prompt (one step and chunked prefill
across the image run), and greedy tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_driver import PagedDriver
from llava_next_fixtures import IMAGE_TOKEN_ID, PROCESSOR, TEXT_HIDDEN, TOKENS_PER_TILE, hf_processor
from vision_fixtures import sample_images

from kiln.manifest import read_manifest
from kiln.runtime import LLM, RuntimeConfig, SamplingParams
from kiln.runtime.vision import llava_next
from kiln.runtime.vision.encoder import ImageEncoder
from kiln.runtime.vision.prompt import expand_image_tokens, image_hash, image_rows

torch = pytest.importorskip("torch")
TEXT = "[INST] <image>\nWhat is shown in this image? [/INST]"
CONFIG = llava_next.LlavaNextImageConfig.from_hf(PROCESSOR)


@pytest.fixture(scope="module")
def hf_model(tiny_llava_next_dir):
    from transformers import LlavaNextForConditionalGeneration

    return LlavaNextForConditionalGeneration.from_pretrained(tiny_llava_next_dir, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def processor(tiny_llava_next_dir):
    return hf_processor(tiny_llava_next_dir)


@pytest.fixture(scope="module")
def llm(tiny_llava_next_engine):
    return LLM(tiny_llava_next_engine, RuntimeConfig(kv_cache_bytes=8 << 20))


@pytest.fixture(scope="module")
def encoder(llm):
    return llm.engine.image_encoder


def hf_inputs(processor, images, text: str = TEXT) -> dict:
    out = processor(text=[text], images=images, return_tensors="pt")
    return {"input_ids": out["input_ids"], "pixel_values": out["pixel_values"].float(),
            "image_sizes": out["image_sizes"]}


def hf_features(hf_model, inputs: dict) -> list[np.ndarray]:
    """LlavaNextModel.get_image_features: each image's packed rows."""
    with torch.no_grad():
        out = hf_model.model.get_image_features(inputs["pixel_values"], inputs["image_sizes"],
                                                vision_feature_layer=-2, vision_feature_select_strategy="default")
    return [f.numpy() for f in out.pooler_output]


def test_manifest_names_the_family(tiny_llava_next_engine):
    vision = read_manifest(tiny_llava_next_engine).vision
    assert vision is not None and vision.family == "llava_next"
    assert (vision.image_token_id, vision.tokens_per_image, vision.image_size) == (IMAGE_TOKEN_ID, 16, 28)


def test_tile_embeddings_and_newline_equal_transformers(encoder, hf_model, processor):
    """The encoder graph on the processor's pixel values (a base image and 3 x 1 tiles): the tower's layer -2
    without CLS, projected; and its second output, the model's image_newline."""
    pixels = hf_inputs(processor, [sample_images()["rgb-portrait"]])["pixel_values"][0]
    ours = encoder.run(pixels.numpy())
    with torch.no_grad():
        hidden = hf_model.model.vision_tower(pixels, output_hidden_states=True).hidden_states[-2][:, 1:]
        theirs = hf_model.model.multi_modal_projector(hidden).numpy()
    assert ours.shape == (4, TOKENS_PER_TILE, TEXT_HIDDEN)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)
    np.testing.assert_array_equal(encoder.image_newline, hf_model.model.image_newline.detach().numpy())


@pytest.mark.parametrize("name", ["rgb-portrait", "rgb-landscape", "rgb-tiny", "rgba", "cmyk"])
def test_packed_features_equal_transformers(encoder, hf_model, processor, name):
    """Kiln's pixels, encoder graph and packing against get_image_features on the processor's pixels; the row
    count computed from the image's size alone is the packed length."""
    image = sample_images()[name]
    ours = encoder.encode([image])[0]
    (theirs,) = hf_features(hf_model, hf_inputs(processor, [image]))
    assert ours.shape == theirs.shape
    assert len(ours) == llava_next.num_tokens(image.height, image.width, CONFIG, TOKENS_PER_TILE)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


def test_each_packing_piece_matters(encoder, hf_model, processor):
    """The comparison above sees every piece: without unpadding (the map as if the image filled its grid), with a
    zero newline, with a grid tile replaced by the base image, with two grid tiles swapped, or with each tile's
    patches transposed, the rows are off."""
    image = sample_images()["rgb-portrait"]  # a 3 x 1 grid whose feature map has a padding row above and below
    (theirs,) = hf_features(hf_model, hf_inputs(processor, [image]))
    tiles = encoder.run(encoder.tiles(image)[0])
    newline = encoder.image_newline
    rows, cols = llava_next.grid(image.height, image.width, CONFIG)
    assert (rows, cols) == (3, 1)
    np.testing.assert_allclose(llava_next.pack(tiles, image.height, image.width, CONFIG, newline), theirs, atol=1e-4)
    unpadding_off = llava_next.pack(tiles, rows * CONFIG.tile_size, cols * CONFIG.tile_size, CONFIG, newline)
    assert unpadding_off.shape != theirs.shape
    side = int(TOKENS_PER_TILE**0.5)
    transposed = tiles.reshape(len(tiles), side, side, -1).swapaxes(1, 2).reshape(tiles.shape)
    for wrong_tiles, wrong_newline in ((tiles, np.zeros_like(newline)), (tiles[[0, 1, 0, 3]], newline),
                                       (tiles[[0, 2, 1, 3]], newline), (transposed, newline)):
        wrong = llava_next.pack(wrong_tiles, image.height, image.width, CONFIG, wrong_newline)
        assert np.abs(wrong - theirs).max() > 0.1


@pytest.mark.parametrize("names", [("rgb-landscape",), ("rgb-portrait", "gray"), ("rgb-tiny", "palette", "rgba")])
def test_placeholders_expand_as_the_processor_writes_them(llm, encoder, processor, names):
    """The run of each image's placeholder, from its size alone, is LlavaNextProcessor's."""
    images = [sample_images()[n] for n in names]
    text = "[INST] " + "".join(f"<image>\nlook {i} " for i in range(len(images))) + "[/INST]"
    theirs = processor(text=[text], images=images, return_tensors="np")["input_ids"][0].tolist()
    layouts = encoder.layouts(images, llm.tokenizer)
    embeddings = [np.zeros((len(layout.token_ids), 8), np.float32) for layout in layouts]
    expanded, spans = expand_image_tokens(llm.tokenizer.encode(text), IMAGE_TOKEN_ID, embeddings,
                                          [str(i) * 64 for i in range(len(images))], layouts)
    assert expanded == theirs and len(spans) == len(images)


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
def test_logits_equal_transformers(tiny_llava_next_engine, llm, encoder, hf_model, processor, chunk):
    """The engine's prompt is the processor's token for token, and its logits are transformers' (in one step, or
    in chunks of 7 whose edges cut the image run)."""
    image = sample_images()["gray"]  # a 2 x 2 grid
    inputs = hf_inputs(processor, [image])
    digest = image_hash(image)
    ids, spans = expand_image_tokens(llm.tokenizer.encode(TEXT), IMAGE_TOKEN_ID, encoder.encode([image], [digest]),
                                     [digest], encoder.layouts([image], llm.tokenizer))
    assert ids == inputs["input_ids"][0].tolist() and len(spans[0].embeddings) > 4 * TOKENS_PER_TILE
    with torch.no_grad():
        theirs = hf_model(**inputs).logits[0].numpy()
    np.testing.assert_allclose(engine_logits(tiny_llava_next_engine, ids, spans, chunk), theirs, rtol=0, atol=1e-3)


def hf_greedy(hf_model, inputs: dict, new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize(("name", "max_num_tokens"), [("rgb-landscape", None), ("cmyk", 16)])
def test_greedy_tokens_equal_transformers(tiny_llava_next_engine, hf_model, processor, name, max_num_tokens):
    image = sample_images()[name]
    llm = LLM(tiny_llava_next_engine, RuntimeConfig(max_num_tokens=max_num_tokens, kv_cache_bytes=8 << 20))
    inputs = hf_inputs(processor, [image])
    out = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), images=[[image]])[0]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(out.outputs[0].token_ids) == hf_greedy(hf_model, inputs, 10)


@pytest.mark.parametrize(("config_change", "processor_change", "problem"), [
    ({}, {"image_grid_pinpoints": [[28, 56]]}, r"image_grid_pinpoints \[\[28, 56\]\] are not config.json's"),
    ({"vision_feature_select_strategy": "full"}, {}, "'full': LLaVA-NeXT packs the tiles' patch grids"),
    ({}, {"crop_size": {"height": 56, "width": 56}}, "is not the vision tower's image_size 28"),
    ({"image_grid_pinpoints": [[30, 56]]}, {"image_grid_pinpoints": [[30, 56]]},
     r"\[30, 56\] is not a grid of the tower's 28-pixel tiles"),
])
def test_a_checkpoint_kiln_cannot_pack_is_refused_by_name(tiny_llava_next_dir, tmp_path, config_change,
                                                          processor_change, problem):
    import json

    from kiln.export.vision.export_encoder import load_vision_of

    for name, change in (("config.json", config_change), ("preprocessor_config.json", processor_change)):
        data = json.loads((tiny_llava_next_dir / name).read_text())
        (tmp_path / name).write_text(json.dumps({**data, **change}))
    (tmp_path / "model.safetensors").symlink_to(tiny_llava_next_dir / "model.safetensors")
    with pytest.raises(ValueError, match=problem):
        load_vision_of(tmp_path)


def test_an_encoder_graph_without_the_newline_is_refused_at_load(tiny_llava_next_engine, tmp_path):
    import shutil

    import onnx
    from onnx import TensorProto, helper

    from kiln.manifest import EngineLoadError

    spec = read_manifest(tiny_llava_next_engine).vision
    shutil.copy(tiny_llava_next_engine / spec.preprocessor, tmp_path / spec.preprocessor)
    graph = helper.make_graph(
        [helper.make_node("Identity", ["pixel_values"], ["image_embeds"])], "no-newline",
        [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["n", 3, 28, 28])],
        [helper.make_tensor_value_info("image_embeds", TensorProto.FLOAT, ["n", 3, 28, 28])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / spec.encoder)
    with pytest.raises(EngineLoadError, match="vision.onnx has no usable image_newline output"):
        ImageEncoder(tmp_path, spec)
