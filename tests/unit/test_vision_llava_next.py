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
