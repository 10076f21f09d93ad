"""LLaVA-1.5 from llama.cpp's two files: `kiln build llava-f32.gguf --mmproj mmproj-llava-f32.gguf`, both made by
llama.cpp's own converters from the tiny random LLaVA of tests/vision_fixtures.py (tests/data/gguf/make_fixtures.py;
fixtures.json's "vision" entries), held to transformers' LlavaForConditionalGeneration of that source model.

The mmproj converter stores the patch convolution and the projector's two matrices in f16 whatever --use-f32 says,
so the reference takes those three weights rounded to f16: the numbers the file holds (the text GGUF is f32, exact).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from vision_fixtures import NUM_IMAGE_TOKENS, sample_images

from kiln.manifest import read_manifest
from kiln.runtime import LLM, RuntimeConfig, SamplingParams
from kiln.runtime.vision.encoder import ImageEncoder

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

DATA = Path(__file__).resolve().parent.parent / "data" / "gguf"
TEXT, MMPROJ = DATA / "llava-f32.gguf", DATA / "mmproj-llava-f32.gguf"
IMAGE_TOKEN_ID = 261
F16_IN_THE_FILE = ("vision_tower.embeddings.patch_embedding.weight", "multi_modal_projector.linear_1.weight",
                   "multi_modal_projector.linear_2.weight")


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    """Built through the CLI, as a user would (the f32 text GGUF builds unquantized; float32 KV for the comparison)."""
    from click.testing import CliRunner

    from kiln.cli import main

    out = tmp_path_factory.mktemp("llava-gguf") / "engine"
    result = CliRunner().invoke(main, ["build", str(TEXT), "--mmproj", str(MMPROJ), "-o", str(out),
                                       "--kv-dtype", "float32"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def hf_model(tiny_llava_dir):
    """The source model with the weights the mmproj holds in f16 rounded to f16."""
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        for name in F16_IN_THE_FILE:
            weight = model.get_parameter("model." + name)
            weight.copy_(weight.half().float())
    return model


@pytest.fixture(scope="module")
def encoder(engine):
    return ImageEncoder(engine, read_manifest(engine).vision)


def test_the_fixtures_are_the_listed_files_of_the_tiny_llava(tiny_llava_dir):
    """The files are fixtures.json's, and the text GGUF holds the regenerated source model's weights exactly (so the
    source is the reference)."""
    from gguf import GGUFReader
    from safetensors import safe_open

    index = json.loads((DATA / "fixtures.json").read_text())["vision"]
    for path in (TEXT, MMPROJ):
        assert hashlib.sha256(path.read_bytes()).hexdigest() == index[path.stem]["sha256"], path.name
    embedding = next(t for t in GGUFReader(str(TEXT)).tensors if t.name == "token_embd.weight")
    with safe_open(str(tiny_llava_dir / "model.safetensors"), "pt") as f:
        source = f.get_tensor("language_model.model.embed_tokens.weight").numpy()
    np.testing.assert_array_equal(np.asarray(embedding.data).reshape(source.shape), source)


def test_the_manifest_and_preprocessing_come_from_the_mmproj(engine, tiny_llava_dir):
    """Image token, tokens per image and sizes as the LLaVA config has them; the pixel values (from the file's size,
    mean and std) equal transformers' CLIPImageProcessor of the source checkpoint."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    vision = read_manifest(engine).vision
    assert (vision.family, vision.image_token_id, vision.tokens_per_image, vision.embedding_size,
            vision.image_size) == ("llava", IMAGE_TOKEN_ID, NUM_IMAGE_TOKENS, 64, 56)
    processor = CLIPImageProcessorPil(**json.loads((tiny_llava_dir / "preprocessor_config.json").read_text()))
    images = [sample_images()[name] for name in ("rgb-portrait", "rgb-landscape", "rgba", "cmyk")]
    theirs = processor(images, return_tensors="np")["pixel_values"]
    ours = ImageEncoder(engine, vision).pixel_values(images)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)


def test_encoder_embeddings_equal_transformers(encoder, hf_model):
    images = [sample_images()[name] for name in ("rgb-portrait", "gray", "palette")]
    pixels = encoder.pixel_values(images)
    ours = encoder.run(pixels)
    with torch.no_grad():
        theirs = hf_model.model.get_image_features(torch.from_numpy(pixels), vision_feature_layer=-2,
                                                   vision_feature_select_strategy="default").pooler_output
    theirs = torch.stack(list(theirs)).numpy()
    assert ours.shape == (3, NUM_IMAGE_TOKENS, 64)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


def test_engine_logits_and_greedy_tokens_equal_transformers(engine, encoder, hf_model):
    """Logits of every row of an image + text prompt within 1e-3 (the engine's own prefill, all rows asked for
    through the runner), then 10 greedy tokens equal transformers' generate."""
    from engine_driver import PagedDriver

    from kiln.runtime.vision.prompt import ImageSpan, image_rows

    image = sample_images()["rgb-landscape"]
    prefix, suffix = [1, 40, 50, 60], [70, 80, 90]
    ids = prefix + [IMAGE_TOKEN_ID] * NUM_IMAGE_TOKENS + suffix
    driver = PagedDriver(engine / "model.onnx", 16)
    spans = (ImageSpan(len(prefix), encoder.encode([image])[0], 1),)
    batch = driver._pack([(0, ids)], all_rows=True)
    [(rows, embeds)] = image_rows(spans, 0, len(ids), 0)
    import dataclasses

    ours = driver.runner.execute(dataclasses.replace(batch, image_rows=rows, image_embeds=embeds))
    pixels = torch.from_numpy(encoder.pixel_values([image]))
    with torch.no_grad():
        theirs = hf_model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0].numpy()
        generated = hf_model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=10,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3)
    llm = LLM(engine, RuntimeConfig(kv_cache_bytes=4 << 20))
    out = llm.generate(prefix + [IMAGE_TOKEN_ID] + suffix, SamplingParams(temperature=0, max_tokens=10,
                                                                        ignore_eos=True), images=[[image]])[0]
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == generated[0, len(ids):].tolist()


def test_chat_with_an_image_uses_the_gguf_tokenizers_image_token(engine):
    """The GGUF's tokenizer keeps <image> whole: a chat image part becomes the 16 image positions."""
    llm = LLM(engine, RuntimeConfig(kv_cache_bytes=4 << 20))
    messages = [{"role": "user", "content": [{"type": "image", "image": sample_images()["gray"]},
                                             {"type": "text", "text": "the"}]}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.prompt_token_ids.count(IMAGE_TOKEN_ID) == NUM_IMAGE_TOKENS and len(out.outputs[0].token_ids) == 3


def _rewrite_mmproj(out: Path, metadata: dict | None = None, rename: dict | None = None) -> Path:
    """The fixture mmproj copied by gguf-py with some metadata replaced and tensors renamed."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(MMPROJ))
    writer = GGUFWriter(str(out), "clip")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = (metadata or {}).get(key, field.contents())
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, kind)
    for key, value in (metadata or {}).items():
        if key not in reader.fields:
            writer.add_string(key, value) if isinstance(value, str) else writer.add_array(key, value)
    for tensor in reader.tensors:
        name = (rename or {}).get(tensor.name, tensor.name)
        writer.add_tensor(name, np.asarray(tensor.data), raw_shape=list(reversed(tensor.shape.tolist())),
                          raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize(("case", "problem"), [
    ("text-as-mmproj", "general.architecture is 'llama', not 'clip'"),
    ("no-image-token", "vocabulary has no <image> token"),
    ("other-width", "not this model's mmproj"),
    ("ldp", "projector type 'ldp'"),
    ("llava-next", "LLaVA-NeXT"),
    ("post-norm", "tensor v.post_ln.weight is not part of LLaVA-1.5's"),
])
def test_an_mmproj_that_does_not_fit_is_refused_by_name(tmp_path, case, problem):
    from kiln.export.checkpoint import load_checkpoint
    from kiln.export.vision.mmproj import load_mmproj

    text, mmproj = TEXT, MMPROJ
    if case == "text-as-mmproj":
        mmproj = TEXT
    elif case == "no-image-token":
        text = DATA / "llama-f32.gguf"  # the same tiny llama body, its vocabulary without <image>
    elif case == "other-width":
        text = DATA / "llama256-q4_0.gguf"
    elif case == "ldp":
        mmproj = _rewrite_mmproj(tmp_path / "ldp.gguf", {"clip.projector_type": "ldp"})
    elif case == "llava-next":
        mmproj = _rewrite_mmproj(tmp_path / "next.gguf", {"clip.vision.image_grid_pinpoints": [336, 672, 672, 336]})
    else:
        mmproj = _rewrite_mmproj(tmp_path / "post.gguf", rename={"v.blk.1.ln2.weight": "v.post_ln.weight"})
    with pytest.raises(ValueError, match=problem):
        load_mmproj(mmproj, load_checkpoint(text))


def test_legacy_and_current_mlp_names_read_alike(tmp_path):
    """llama.cpp's legacy converter wrote CLIP's fc1 as ffn_down; newer ones write it as ffn_up. Both read as fc1."""
    from kiln.export.checkpoint import load_checkpoint
    from kiln.export.vision.mmproj import load_mmproj

    swap = {f"v.blk.{i}.ffn_{a}.{k}": f"v.blk.{i}.ffn_{b}.{k}" for i in range(2) for a, b in (("up", "down"),
                                                                                           ("down", "up"))
            for k in ("weight", "bias")}
    text = load_checkpoint(TEXT)
    legacy, current = load_mmproj(MMPROJ, text), load_mmproj(_rewrite_mmproj(tmp_path / "new.gguf", rename=swap), text)
    assert set(legacy.weights) == set(current.weights)
    for name in legacy.weights:
        torch.testing.assert_close(legacy.weights[name], current.weights[name], rtol=0, atol=0)
    assert legacy.weights.shape("tower.encoder.layers.0.mlp.fc1.weight") == (64, 32)


def test_mmproj_with_an_hf_vision_checkpoint_is_refused(tiny_llava_dir, tmp_path):
    from kiln.optimize.build import BuildError, build_engine

    with pytest.raises(BuildError, match="has its own image encoder; --mmproj goes with a text model"):
        build_engine(tiny_llava_dir, tmp_path / "e", mmproj=MMPROJ, progress=lambda _m: None)
    assert not (tmp_path / "e").exists()
    shutil.rmtree(tmp_path, ignore_errors=True)
