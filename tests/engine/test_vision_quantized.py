"""The int8 image encoders (`kiln build --vision-quantization int8 | int8-weight-only`, optimize/vision_encoder.py)
on the tiny LLaVA (CLIP tower + MLP projector; both schemes) and the tiny Gemma 3 (SigLIP tower + pooling
projector; int8): embeddings near transformers' get_image_features, greedy tokens on an image prompt equal to the
float32 encoder's engine, every linear layer of the graph quantized, the manifest saying so; a text-only model
refuses the flag.

Tolerance: int8 weights per output channel (step max|w|/127 a row) and int8 activations (per token, or per block
of 128 in MatMulNBits) move each linear's output by a few tenths of a percent; through the tiny towers' 2 layers
and the projector the embeddings moved by 0.9-1.8% (relative Frobenius error) with every token's cosine above
0.9996 on random pixels. The bounds below (4%, 0.999) leave twice that; a wrong scale, row order or zero point
is O(1) off.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from gemma3_vision_fixtures import TEXT_HIDDEN, TOKENS_PER_IMAGE, hf_processor
from vision_fixtures import NUM_IMAGE_TOKENS, sample_images

from kiln.manifest import BuildOptions, read_manifest
from kiln.optimize.build import BuildError, build_engine
from kiln.runtime import LLM, RuntimeConfig, SamplingParams
from kiln.runtime.vision.encoder import ImageEncoder
from kiln.vision import EncoderQuantization

torch = pytest.importorskip("torch")
INT8 = BuildOptions(kv_dtype="float32", vision_quantization=EncoderQuantization.INT8)
WEIGHT_ONLY = BuildOptions(kv_dtype="float32", vision_quantization=EncoderQuantization.INT8_WEIGHT_ONLY)
# the node each scheme's linears become
QUANTIZED_OP = {EncoderQuantization.INT8: "MatMulIntegerToFloat", EncoderQuantization.INT8_WEIGHT_ONLY: "MatMulNBits"}
LLAVA_IMAGE_TOKEN_ID = 261
GEMMA3_TEXT = "<start_of_turn>user\n<start_of_image>What is in this picture?<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def llava_int8_engine(tmp_path_factory, tiny_llava_dir):
    out = tmp_path_factory.mktemp("tiny-llava-int8") / "engine"
    build_engine(tiny_llava_dir, out, INT8, progress=lambda _msg: None)
    return out


@pytest.fixture(scope="module")
def llava_weight_only_engine(tmp_path_factory, tiny_llava_dir):
    out = tmp_path_factory.mktemp("tiny-llava-int8-weight-only") / "engine"
    build_engine(tiny_llava_dir, out, WEIGHT_ONLY, progress=lambda _msg: None)
    return out


@pytest.fixture(scope="module")
def gemma3_int8_engine(tmp_path_factory, tiny_gemma3_vlm_dir):
    out = tmp_path_factory.mktemp("tiny-gemma3-int8") / "engine"
    build_engine(tiny_gemma3_vlm_dir, out, INT8, progress=lambda _msg: None)
    return out


def assert_near(ours: np.ndarray, theirs: np.ndarray) -> None:
    relative = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
    cosine = (ours * theirs).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(theirs, axis=-1))
    assert relative < 0.04, relative
    assert cosine.min() > 0.999, cosine.min()
    assert relative > 1e-4, "the int8 encoder equals float32: nothing was quantized"  # float32 is within 1e-5


@pytest.fixture(scope="module")
def llava_hf(tiny_llava_dir):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir).eval()


@pytest.mark.parametrize("engine", ["llava_int8_engine", "llava_weight_only_engine"])
def test_llava_embeddings_near_transformers(request, engine, llava_hf):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    path = request.getfixturevalue(engine)
    processor = CLIPImageProcessorPil(**json.loads((path / "preprocessor_config.json").read_text()))
    pixels = processor([sample_images()[n] for n in ("rgb-portrait", "gray", "rgba")], return_tensors="np")
    ours = ImageEncoder(path, read_manifest(path).vision).run(pixels["pixel_values"].astype(np.float32))
    with torch.no_grad():
        theirs = llava_hf.model.get_image_features(torch.from_numpy(pixels["pixel_values"]), vision_feature_layer=-2,
                                                   vision_feature_select_strategy="default").pooler_output
    assert ours.shape == (3, NUM_IMAGE_TOKENS, 64)
    assert_near(ours, torch.stack(list(theirs)).numpy())


def test_gemma3_embeddings_near_transformers(gemma3_int8_engine, tiny_gemma3_vlm_dir):
    from transformers import Gemma3ForConditionalGeneration

    hf_model = Gemma3ForConditionalGeneration.from_pretrained(tiny_gemma3_vlm_dir).eval()
    processor = hf_processor(tiny_gemma3_vlm_dir)
    pixels = torch.cat([processor(text=[GEMMA3_TEXT], images=[[sample_images()[n]]], return_tensors="pt")
                        ["pixel_values"].float() for n in ("rgb-portrait", "cmyk")])
    ours = ImageEncoder(gemma3_int8_engine, read_manifest(gemma3_int8_engine).vision).run(pixels.numpy())
    with torch.no_grad():
        theirs = hf_model.model.get_image_features(pixels).pooler_output.numpy()
    assert ours.shape == (2, TOKENS_PER_IMAGE, TEXT_HIDDEN)
    assert_near(ours, theirs.reshape(ours.shape))


def greedy(engine, prompt, image) -> list[int]:
    llm = LLM(engine, RuntimeConfig(kv_cache_bytes=8 << 20))
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), images=[[image]])
    return list(out[0].outputs[0].token_ids)


@pytest.mark.parametrize(("engine", "name"), [("llava_int8_engine", "rgb-portrait"),
                                              ("llava_int8_engine", "rgb-landscape"),
                                              ("llava_weight_only_engine", "rgb-portrait")])
def test_llava_greedy_tokens_equal_the_float32_encoders(request, engine, tiny_llava_engine, name):
    prompt = [1, 40, 50, 60, LLAVA_IMAGE_TOKEN_ID, 70, 80, 90, 100, 110]
    image = sample_images()[name]
    assert greedy(request.getfixturevalue(engine), prompt, image) == greedy(tiny_llava_engine, prompt, image)


@pytest.mark.parametrize("name", ["rgb-landscape", "palette"])
def test_gemma3_greedy_tokens_equal_the_float32_encoders(gemma3_int8_engine, tiny_gemma3_vlm_engine, name):
    image = sample_images()[name]
    assert greedy(gemma3_int8_engine, GEMMA3_TEXT, image) == greedy(tiny_gemma3_vlm_engine, GEMMA3_TEXT, image)


@pytest.mark.parametrize(("engine", "linears"), [("llava_int8_engine", 10), ("llava_weight_only_engine", 10),
                                                 ("gemma3_int8_engine", 9)])
def test_every_linear_layer_is_int8(request, engine, linears):
    """LLaVA: 2 layers x (fused q/k/v, out, fc1, fc2) + the projector's 2; Gemma 3: 2 x 4 + its projection.
    What stays float: the patch convolution and attention's activation-by-activation MatMuls."""
    path = request.getfixturevalue(engine)
    scheme = read_manifest(path).build.vision_quantization
    assert json.loads((path / "manifest.json").read_text())["build"]["vision_quantization"] == scheme.value
    graph = onnx.load(path / "vision.onnx", load_external_data=False).graph
    initializers = {init.name: init for init in graph.initializer}
    quantized = [node for node in graph.node if node.op_type == QUANTIZED_OP[scheme]]
    assert len(quantized) == linears
    for node in quantized:  # the weight: MatMulIntegerToFloat's input 1 (uint8, zero point 128), MatMulNBits' B
        assert initializers[node.input[1]].data_type == onnx.TensorProto.UINT8
        if node.op_type == "MatMulNBits":
            assert {a.name: a.i for a in node.attribute}["bits"] == 8
    assert not [node.name for node in graph.node if node.op_type in ("MatMul", "Gemm")
                and any(name in initializers for name in node.input)]


def test_the_float32_encoder_is_recorded(tiny_llava_engine):
    assert read_manifest(tiny_llava_engine).build.vision_quantization is EncoderQuantization.FLOAT32


def test_a_text_only_model_refuses_vision_quantization(tiny_model_dir, tmp_path):
    with pytest.raises(BuildError, match="--vision-quantization int8 quantizes a vision-language model's image "
                                         "encoder, and .* is a text-only model"):
        build_engine(tiny_model_dir, tmp_path / "engine", INT8, progress=lambda _msg: None)
    assert not (tmp_path / "engine").exists()


def test_the_cli_flag_reaches_the_build(tiny_model_dir, tmp_path):
    from click.testing import CliRunner

    from kiln.cli import main

    result = CliRunner().invoke(main, ["build", str(tiny_model_dir), "-o", str(tmp_path / "engine"),
                                       "--vision-quantization", "int8-weight-only"])
    assert result.exit_code == 1
    assert "--vision-quantization int8-weight-only quantizes a vision-language model's image encoder" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "engine").exists()
