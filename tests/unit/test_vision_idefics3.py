"""Idefics3 / SmolVLM images held to transformers' image processor: kiln's tiles (runtime/vision/idefics3.py)
against SmolVLMImageProcessorPil's pixel values. (The prompt layout against Idefics3Processor's token ids needs the
SmolLM2 tokenizer: tests/engine/test_vision_smolvlm.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from smolvlm_fixtures import IMAGE_TOKEN_ID, PROCESSOR, TOKENS_PER_TILE
from vision_fixtures import sample_images

from kiln.runtime.vision import idefics3

pytest.importorskip("transformers")
pytest.importorskip("PIL")

CONFIG = idefics3.Idefics3ImageConfig.from_hf(PROCESSOR)
# (rows, cols) the tiny processor (longest edge 256, tiles of 64) cuts each sample into
GRIDS = {"rgb-portrait": (4, 2), "rgb-landscape": (1, 4), "rgb-tiny": (3, 4), "gray": (4, 4), "rgba": (4, 4),
         "palette": (3, 4), "cmyk": (4, 4)}


def hf_image_processor(**overrides):
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    return SmolVLMImageProcessorPil(**{**settings, **overrides})


def hf_pixels(image, **overrides) -> tuple[np.ndarray, int, int]:
    out = hf_image_processor(**overrides)(images=[[image]], return_tensors="np", return_row_col_info=True)
    return out["pixel_values"][0], out["rows"][0][0], out["cols"][0][0]


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_tiles_equal_transformers(name):
    image = sample_images()[name]
    ours, rows, cols = idefics3.pixel_values(image, CONFIG)
    theirs, hf_rows, hf_cols = hf_pixels(image)
    assert (rows, cols) == (hf_rows, hf_cols) == GRIDS[name]
    assert ours.shape == theirs.shape == (rows * cols + 1, 3, 64, 64)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
    assert idefics3.grid(image.height, image.width, CONFIG) == (rows, cols)


@pytest.mark.parametrize("overrides", [{"do_image_splitting": False}, {"size": {"longest_edge": 64}},
                                       {"size": {"longest_edge": 100}, "resample": 3}])
def test_unsplit_and_other_settings_equal_transformers(overrides):
    config = idefics3.Idefics3ImageConfig.from_hf({**PROCESSOR, **overrides})
    for image in (sample_images()["rgb-landscape"], sample_images()["rgb-portrait"]):
        ours, rows, cols = idefics3.pixel_values(image, config)
        theirs, hf_rows, hf_cols = hf_pixels(image, **overrides)
        assert (rows, cols) == (hf_rows, hf_cols)
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)


def test_a_tile_out_of_place_is_caught():
    """The comparison above sees the tile order: the global image moved first no longer matches."""
    image = sample_images()["rgb-landscape"]
    ours, _, _ = idefics3.pixel_values(image, CONFIG)
    theirs, _, _ = hf_pixels(image)
    assert np.abs(np.roll(ours, 1, axis=0) - theirs).max() > 0.1


def test_a_tokenizer_without_the_tile_tokens_is_refused():
    class Plain:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [ord(c) for c in text]

    with pytest.raises(ValueError, match="no <fake_token_around_image> token"):
        idefics3.Idefics3Prompt(Plain(), IMAGE_TOKEN_ID, TOKENS_PER_TILE)
