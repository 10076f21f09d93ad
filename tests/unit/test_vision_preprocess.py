"""kiln's numpy/Pillow CLIP preprocessing against transformers' CLIPImageProcessor (PIL backend), on images of
odd sizes and modes; and each step shown to matter: with any one of them off the pixel values differ."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from vision_fixtures import CLIP_MEAN, CLIP_STD, IMAGE_SIZE, sample_images

from kiln.runtime.vision.preprocess import ClipImageConfig, preprocess

pytest.importorskip("transformers")

HF_CONFIG = {"size": {"shortest_edge": IMAGE_SIZE}, "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
             "resample": 3, "do_center_crop": True, "do_rescale": True, "rescale_factor": 1 / 255,
             "do_normalize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True}
STEPS = ("do_convert_rgb", "do_resize", "do_center_crop", "do_rescale", "do_normalize")


@pytest.fixture(scope="module")
def hf_pixels():
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    processor = CLIPImageProcessorPil(**HF_CONFIG)
    return {name: processor(image, return_tensors="np")["pixel_values"][0]
            for name, image in sample_images().items()}


@pytest.mark.parametrize("name", list(sample_images()))
def test_pixel_values_equal_transformers(name, hf_pixels):
    ours = preprocess(sample_images()[name], ClipImageConfig.from_hf(HF_CONFIG))
    assert ours.dtype == np.float32 and ours.shape == (3, IMAGE_SIZE, IMAGE_SIZE)
    np.testing.assert_allclose(ours, hf_pixels[name], rtol=0, atol=1e-5)


@pytest.mark.parametrize("step", STEPS)
def test_each_step_matters(step, hf_pixels):
    config = dataclasses.replace(ClipImageConfig.from_hf(HF_CONFIG), **{step: False})
    differs = []
    for name, image in sample_images().items():
        try:
            ours = preprocess(image, config)
        except ValueError:  # e.g. 4 channels against 3 means without do_convert_rgb
            differs.append(True)
            continue
        differs.append(ours.shape != hf_pixels[name].shape or not np.allclose(ours, hf_pixels[name], atol=1e-5))
    assert any(differs), f"turning {step} off changed no image's pixel values"


def test_config_round_trips_and_reads_the_saved_processor(tmp_path):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    CLIPImageProcessorPil(**HF_CONFIG).save_pretrained(tmp_path)
    config = ClipImageConfig.from_hf(json.loads((tmp_path / "preprocessor_config.json").read_text()))
    assert config == ClipImageConfig.from_hf(HF_CONFIG)
    assert ClipImageConfig.from_hf(config.to_dict()) == config


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="shortest_edge"):
        ClipImageConfig.from_hf({**HF_CONFIG, "size": {"height": 4, "width": 4}})
    with pytest.raises(ValueError, match="image_std"):
        ClipImageConfig.from_hf({**HF_CONFIG, "image_std": [1.0, 0.0, 1.0]})
