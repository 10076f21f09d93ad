"""A tiny random-weight LLaVA-1.5 checkpoint, and a handful of test images.

    path = make_tiny_llava(tmp_path)

writes LlavaForConditionalGeneration (config.json + model.safetensors), its CLIP image processor
(preprocessor_config.json) and the tiny byte-level tokenizer with an ``<image>`` token into
``tmp_path / "llava"``. The config is llava-hf/llava-1.5-7b-hf's, shrunk: the CLIP ViT-L/14-336 tower
(24 layers, hidden 1024, quick_gelu, image 336 / patch 14 -> 576 image tokens) becomes 3 layers, hidden 32,
image 56 / patch 14 -> 16 image tokens; the Llama body is tests/helpers.py's tiny llama. The feature layer stays
-2 (so the tower's last layer is computed by transformers but unused) and the select strategy "default"
(drop CLS), as in the real model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from helpers import _randomize, tiny_hf_config, write_tiny_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 56
PATCH_SIZE = 14
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def tiny_llava_config(**text_overrides):
    from transformers import CLIPVisionConfig, LlavaConfig

    text = tiny_hf_config("llama", **text_overrides)
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE, projection_dim=32, hidden_act="quick_gelu", layer_norm_eps=1e-5, num_channels=3,
    )
    image_token_id = 261  # the tiny tokenizer's first free id: 3 specials + 256 bytes + 2 merges
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=image_token_id, projector_hidden_act="gelu",
        vision_feature_layer=-2, vision_feature_select_strategy="default", image_seq_length=NUM_IMAGE_TOKENS,
        multimodal_projector_bias=True, tie_word_embeddings=text.tie_word_embeddings,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    return config


def make_tiny_llava(tmp_path, seed: int = 0, **text_overrides) -> Path:
    import torch
    from transformers import CLIPImageProcessor, LlavaForConditionalGeneration

    config = tiny_llava_config(**text_overrides)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    _randomize_vlm(model, seed)
    out = Path(tmp_path) / "llava"
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, resample=3,
        do_center_crop=True, do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=CLIP_MEAN,
        image_std=CLIP_STD, do_convert_rgb=True,
    )
    processor.save_pretrained(out)
    write_tiny_tokenizer(out)
    _add_image_token(out, config.image_token_id)
    return out


def _randomize_vlm(model, seed: int) -> None:
    """tests/helpers' O(1)-logit weights for the text part; the CLIP norms near 1 and its biases small too."""
    import torch

    _randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "vision_tower" in name and ("layer_norm" in name or "layrnorm" in name) and name.endswith("weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(("class_embedding", "position_embedding.weight")):
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))


def _add_image_token(out: Path, token_id: int) -> None:
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    assert tokenizer.token_to_id(IMAGE_TOKEN) == token_id, tokenizer.token_to_id(IMAGE_TOKEN)
    tokenizer.save(str(out / "tokenizer.json"))


def sample_images() -> dict[str, object]:
    """Images of odd sizes and modes: portrait, landscape, smaller than the crop, grayscale, RGBA with
    transparency, palette, CMYK."""
    from PIL import Image

    rng = np.random.default_rng(7)

    def noise(h: int, w: int, c: int) -> np.ndarray:
        return rng.integers(0, 256, size=(h, w, c), dtype=np.uint8)

    rgba = noise(61, 47, 4)
    rgba[:10, :, 3] = 0  # fully transparent rows composite onto white
    return {
        "rgb-portrait": Image.fromarray(noise(97, 41, 3)),
        "rgb-landscape": Image.fromarray(noise(33, 130, 3)),
        "rgb-tiny": Image.fromarray(noise(9, 13, 3)),
        "gray": Image.fromarray(noise(70, 59, 1)[..., 0], mode="L"),
        "rgba": Image.fromarray(rgba, mode="RGBA"),
        "palette": Image.fromarray(noise(45, 77, 3)).convert("P"),
        "cmyk": Image.fromarray(noise(58, 58, 4), mode="CMYK"),
    }
