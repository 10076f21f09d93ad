"""A tiny random-weight LLaVA-NeXT checkpoint, built with transformers' own classes, and its processor.

    path = make_tiny_llava_next(tmp_path)

writes LlavaNextForConditionalGeneration (config.json + model.safetensors), its image processor
(preprocessor_config.json) and the tiny byte-level tokenizer with an ``<image>`` token into
``tmp_path / "llava_next"``. The config is llava-hf/llava-v1.6-mistral-7b-hf's, shrunk: the CLIP ViT-L/14-336 tower
(24 layers, hidden 1024, image 336 / patch 14 -> 576 rows a tile) becomes 3 layers, hidden 32, image 28 / patch 7
-> 16 rows a tile; the grid pinpoints scale with the tile (336 -> 28: 1x2, 2x1, 2x2, 3x1, 1x3 tiles, as in the
real one), so an image is 16 base rows plus up to 8 x 8 unpadded rows and their newlines. The Mistral body
(32 layers, hidden 4096, 32 heads / 8 KV heads, rope_theta 1e6, no sliding window) is tests/helpers.py's tiny
mistral. Feature layer -2, select strategy "default", gelu projector, as in the real model.
"""

from __future__ import annotations

import json
from pathlib import Path

from helpers import tiny_hf_config, write_tiny_tokenizer
from vision_fixtures import CLIP_MEAN, CLIP_STD, _add_image_token, _randomize_vlm

IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = 261  # the tiny tokenizer's first free id
TILE_SIZE = 28
PATCH_SIZE = 7
TOKENS_PER_TILE = (TILE_SIZE // PATCH_SIZE) ** 2
TEXT_HIDDEN = 64
PINPOINTS = [[28, 56], [56, 28], [56, 56], [84, 28], [28, 84]]
PROCESSOR = {
    "image_processor_type": "LlavaNextImageProcessor", "size": {"shortest_edge": TILE_SIZE},
    "crop_size": {"height": TILE_SIZE, "width": TILE_SIZE}, "image_grid_pinpoints": PINPOINTS, "resample": 3,
    "do_resize": True, "do_center_crop": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True, "do_pad": True,
}


def tiny_llava_next_config():
    from transformers import CLIPVisionConfig, LlavaNextConfig

    text = tiny_hf_config("mistral", rope_theta=1000000.0, tie_word_embeddings=False)
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=TILE_SIZE,
        patch_size=PATCH_SIZE, projection_dim=32, hidden_act="quick_gelu", layer_norm_eps=1e-5, num_channels=3,
    )
    config = LlavaNextConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID, projector_hidden_act="gelu",
        vision_feature_layer=-2, vision_feature_select_strategy="default", image_grid_pinpoints=PINPOINTS,
        multimodal_projector_bias=True, tie_word_embeddings=False, use_image_newline_parameter=True,
    )
    config.architectures = ["LlavaNextForConditionalGeneration"]
    return config


def make_tiny_llava_next(tmp_path, seed: int = 0) -> Path:
    import torch
    from transformers import LlavaNextForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(tiny_llava_next_config()).eval()
    _randomize_vlm(model, seed)
    with torch.no_grad():  # the newline as large as a token embedding, so a missing or misplaced one shows
        model.model.image_newline.copy_(0.5 * torch.randn(TEXT_HIDDEN, generator=torch.Generator().manual_seed(seed)))
    out = Path(tmp_path) / "llava_next"
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=2))
    write_tiny_tokenizer(out)
    _add_image_token(out, IMAGE_TOKEN_ID)
    return out


def hf_image_processor():
    """transformers' LlavaNextImageProcessor (PIL backend) with the checkpoint's settings."""
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    return LlavaNextImageProcessorPil(**{k: v for k, v in PROCESSOR.items() if k != "image_processor_type"})


def hf_processor(folder: Path):
    """transformers' LlavaNextProcessor (the prompt layout) over the PIL image processor and the tiny tokenizer, set
    as llava-v1.6's processor_config.json sets it (the CLS counted, then dropped by the "default" strategy)."""
    from transformers import LlavaNextProcessor, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    return LlavaNextProcessor(hf_image_processor(), tokenizer, patch_size=PATCH_SIZE, num_additional_image_tokens=1,
                              vision_feature_select_strategy="default", image_token=IMAGE_TOKEN)
