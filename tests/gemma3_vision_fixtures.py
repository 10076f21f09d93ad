"""A tiny random-weight Gemma 3 vision-language checkpoint, built with transformers' own classes, and its processor.

    path = make_tiny_gemma3_vlm(tmp_path)

writes Gemma3ForConditionalGeneration (config.json + model.safetensors), its image processor
(preprocessor_config.json) and a byte-level tokenizer with Gemma 3's image tokens into ``tmp_path / "gemma3-vlm"``.
The config is google/gemma-3-4b-it's, shrunk: the SigLIP tower (27 layers, hidden 1152, 16 heads, image 896 /
patch 14 = 64 x 64 patches, gelu_pytorch_tanh) becomes 2 layers, hidden 32, 4 heads, image 64 / patch 4 = 16 x 16
patches; mm_tokens_per_image 256 -> 16 keeps the real pooling kernel of 4. The text model is tests/helpers.py's
"gemma3-4b" (linear RoPE scaling 8 on global layers, query_pre_attn_scalar 256, local RoPE base 10000), 3 layers
of which the last is global, sliding window 1024 -> 24 (shorter than the test prompts, longer than an image).
The processor resizes to the tower's size with bilinear resampling and the 0.5 mean / std, as the real one.
The tokenizer's merges join "\\n\\n" and "\\n\\n\\n" as Gemma's vocabulary does, so a newline next to the layout's
"\\n\\n" tokenizes differently in text than on ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from helpers import TINY_BOS_ID, TINY_EOS_ID, TINY_SPECIAL_TOKENS, tiny_hf_config

IMAGE_SIZE = 64
PATCH_SIZE = 4
TOKENS_PER_IMAGE = 16
TEXT_HIDDEN = 64
SLIDING_WINDOW = 24
ADDED_TOKENS = ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>")
BOI_ID, EOI_ID, IMAGE_ID = 263, 264, 265
MERGES = (("\u010a", "\u010a"), ("\u010a\u010a", "\u010a"))  # "\n\n", "\n\n\n" (byte-level "Ċ")
# Gemma 3's chat template over string contents (kiln hands it those, image parts already "<start_of_image>")
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<start_of_turn>"
                 "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
                 "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
                 "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
PROCESSOR = {
    "image_processor_type": "Gemma3ImageProcessor", "do_convert_rgb": True, "do_resize": True,
    "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "resample": 2, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "do_pan_and_scan": False,
}


def tiny_gemma3_vlm_config():
    from transformers import Gemma3Config

    text = tiny_hf_config("gemma3-4b", num_hidden_layers=3, head_dim=32, sliding_window=SLIDING_WINDOW,
                          layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                          vocab_size=272, tie_word_embeddings=True).to_dict()
    vision = {
        "model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_channels": 3, "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE,
        "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "vision_use_head": False,
    }
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
                          boi_token_index=BOI_ID, eoi_token_index=EOI_ID, image_token_index=IMAGE_ID,
                          tie_word_embeddings=True)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    return config


def make_tiny_gemma3_vlm(tmp_path, seed: int = 0) -> Path:
    import torch
    from transformers import Gemma3ForConditionalGeneration
    from vision_fixtures import _randomize_vlm

    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(tiny_gemma3_vlm_config()).eval()
    _randomize_vlm(model, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # the SigLIP LayerNorms near 1 / 0 (Gemma's (1 + w) norms keep w near 0)
        for name, param in model.named_parameters():
            if "vision_tower" in name and "norm" in name:
                param.copy_((name.endswith("weight") * 1.0) + 0.1 * torch.randn(param.shape, generator=gen))
    out = Path(tmp_path) / "gemma3-vlm"
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=2))
    write_gemma3_tokenizer(out)
    return out


def write_gemma3_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer (3 specials, 256 bytes, the two newline merges) plus Gemma 3's tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS)}
    vocab.update({ch: len(vocab) + i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))})
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGES)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in (*TINY_SPECIAL_TOKENS, *ADDED_TOKENS)])
    assert tokenizer.token_to_id("<image_soft_token>") == IMAGE_ID
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": TINY_SPECIAL_TOKENS[TINY_BOS_ID],
              "eos_token": TINY_SPECIAL_TOKENS[TINY_EOS_ID], "add_bos_token": False, "add_eos_token": False,
              "chat_template": CHAT_TEMPLATE, "model_max_length": 512}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def hf_processor(folder: Path):
    """transformers' Gemma3Processor over its PIL image processor and the checkpoint's tokenizer."""
    from transformers import Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), bos_token=TINY_SPECIAL_TOKENS[TINY_BOS_ID],
        eos_token=TINY_SPECIAL_TOKENS[TINY_EOS_ID],
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    return Gemma3Processor(Gemma3ImageProcessorPil(**settings), tokenizer, image_seq_length=TOKENS_PER_IMAGE)
