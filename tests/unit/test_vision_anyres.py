"""kiln's numpy/Pillow LLaVA-NeXT preprocessing against transformers' LlavaNextImageProcessor (PIL backend) on images
of odd sizes and modes, each step shown to matter; and the grid and unpadding arithmetic against transformers' own
functions over many image sizes, with llava-v1.6's real 336-pixel pinpoints as well as the tiny test ones."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from llava_next_fixtures import PINPOINTS, PROCESSOR, TILE_SIZE, hf_image_processor
from vision_fixtures import sample_images

from kiln.runtime.vision import llava_next
from kiln.runtime.vision.llava_next import LlavaNextImageConfig

pytest.importorskip("transformers")
CONFIG = LlavaNextImageConfig.from_hf(PROCESSOR)
REAL_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


@pytest.fixture(scope="module")
def hf_pixels():
    processor = hf_image_processor()
    return {name: processor(image, return_tensors="np")["pixel_values"][0] for name, image in sample_images().items()}


@pytest.mark.parametrize("name", list(sample_images()))
def test_pixel_values_equal_transformers(name, hf_pixels):
    image = sample_images()[name]
    ours = llava_next.pixel_values(image, CONFIG)
    rows, cols = llava_next.grid(image.height, image.width, CONFIG)
    assert ours.dtype == np.float32 and ours.shape == (1 + rows * cols, 3, TILE_SIZE, TILE_SIZE)
    np.testing.assert_allclose(ours, hf_pixels[name], rtol=0, atol=1e-5)


def test_each_step_matters(hf_pixels):
    """The portrait (a 3 x 1 grid, padded left and right): stretched onto the grid instead of fitted and padded,
    with the base image last instead of first, or with the grid's tiles out of order, the pixels differ."""
    image = sample_images()["rgb-portrait"]
    theirs = hf_pixels["rgb-portrait"]
    ours = llava_next.pixel_values(image, CONFIG)
    stretched = llava_next.pixel_values(image.resize((TILE_SIZE, 3 * TILE_SIZE), resample=3), CONFIG)
    assert stretched.shape == theirs.shape and np.abs(stretched[1:] - theirs[1:]).max() > 0.5
    assert np.abs(np.roll(ours, -1, axis=0) - theirs).max() > 0.5
    landscape = sample_images()["rgb-landscape"]  # a 1 x 3 grid: its tiles right to left
    theirs_landscape = hf_image_processor()(landscape, return_tensors="np")["pixel_values"][0]
    assert np.abs(llava_next.pixel_values(landscape, CONFIG)[[0, 3, 2, 1]] - theirs_landscape).max() > 0.5


@pytest.mark.parametrize("pinpoints", [PINPOINTS, REAL_PINPOINTS])
def test_grid_and_unpadding_equal_transformers(pinpoints):
    """get_anyres_image_grid_shape and unpad_image (the model's) and the processor's token count, over 400 sizes
    from 1 pixel to 4x the largest grid, against kiln's grid, unpadded window and num_tokens."""
    import torch
    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

    tile = pinpoints[0][0]
    side = tile // 7 if tile == TILE_SIZE else tile // 14
    config = LlavaNextImageConfig(dataclasses.replace(CONFIG.clip, shortest_edge=tile, crop_height=tile,
                                                      crop_width=tile), tuple(map(tuple, pinpoints)))
    rng = np.random.default_rng(3)
    sizes = [(1, 1), (tile, tile), (3 * tile, tile), *rng.integers(1, 4 * max(map(max, pinpoints)), size=(397, 2))]
    for height, width in sizes:
        height, width = int(height), int(width)
        rows, cols = llava_next.grid(height, width, config)
        assert (rows, cols) == get_anyres_image_grid_shape([height, width], pinpoints, tile)
        feature_map = torch.zeros(1, rows * side, cols * side)
        unpadded = unpad_image(feature_map, [height, width]).shape[1:]
        top, bottom, left, right = llava_next.unpadded_window(height, width, rows * side, cols * side)
        assert (bottom - top, right - left) == tuple(unpadded), (height, width)
        assert llava_next.num_tokens(height, width, config, side * side) == side * side + unpadded[0] * (
            unpadded[1] + 1)


@pytest.mark.parametrize(("change", "problem"), [
    ({"image_grid_pinpoints": [[28, 50]]}, r"\[28, 50\] is not a grid of 28-pixel tiles"),
    ({"image_grid_pinpoints": "anyres"}, "not a list of \\[height, width\\] pairs"),
    ({"image_grid_pinpoints": []}, "image_grid_pinpoints is empty"),
    ({"crop_size": {"height": 28, "width": 56}}, "tiles are square"),
])
def test_bad_processor_configs_are_named(change, problem):
    with pytest.raises(ValueError, match=problem):
        LlavaNextImageConfig.from_hf({**PROCESSOR, **change})


# llava-hf/llava-v1.6-mistral-7b-hf's config.json and preprocessor_config.json (sparse: transformers' defaults
# fill the rest)
REAL_CONFIG = {
    "architectures": ["LlavaNextForConditionalGeneration"], "image_grid_pinpoints": REAL_PINPOINTS,
    "image_token_index": 32000, "model_type": "llava_next", "projector_hidden_act": "gelu",
    "text_config": {"architectures": ["MistralForCausalLM"], "intermediate_size": 14336,
                    "max_position_embeddings": 32768, "model_type": "mistral", "num_key_value_heads": 8,
                    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None, "vocab_size": 32064},
    "use_image_newline_parameter": True,
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
}
REAL_PROCESSOR = {**PROCESSOR, "size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336},
                  "image_grid_pinpoints": REAL_PINPOINTS}


def test_the_real_sparse_config_reads_as_transformers_reads_it():
    """The text body as MistralForCausalLM with MistralConfig's defaults where the nested config is silent (32
    layers, 32 heads, hidden 4096), the tower as CLIPVisionConfig's (quick_gelu) up to layer -2: 576 rows a tile."""
    from transformers import LlavaNextConfig

    from kiln.export.vision import llava_config, llava_next_config
    from kiln.spec import ModelSpec

    theirs = LlavaNextConfig(**{k: v for k, v in REAL_CONFIG.items() if k not in ("architectures", "model_type")})
    spec = ModelSpec.from_hf_config(llava_config.llava_text_config(REAL_CONFIG))
    text = theirs.text_config
    assert spec.family == "mistral" and spec.sliding_window == 0
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.intermediate_size,
            spec.vocab_size, spec.rope_theta, spec.tie_word_embeddings) == (
        text.num_hidden_layers, text.hidden_size, text.num_attention_heads, text.num_key_value_heads,
        text.intermediate_size, text.vocab_size, 1000000.0, theirs.tie_word_embeddings)
    tower = llava_config.clip_tower_spec(REAL_CONFIG)
    assert (tower.tokens_per_image, tower.num_layers, tower.hidden_act) == (576, 23, theirs.vision_config.hidden_act)
    llava_next_config.check_any_resolution(REAL_CONFIG, REAL_PROCESSOR, tower)
    config = LlavaNextImageConfig.from_hf(REAL_PROCESSOR)
    assert llava_next.num_tokens(672, 672, config, 576) == 576 + 48 * 49
