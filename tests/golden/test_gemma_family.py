"""Gemma 2 / 3: every family piece matters. Each mutation below removes one piece from the spec or the weights
kiln loads; the reference model then leaves transformers' logits by more than ten times the parity tolerance
(1e-4) the golden tests hold kiln to, so those tests fail when the piece is dropped anywhere on the way."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import make_tiny_hf_model

from kiln.export import ReferenceModel, load_checkpoint
from kiln.spec import ModelSpec


def _norms_without_plus_one(spec, weights):
    return spec, {k: w - 1 if k.endswith("norm.weight") else w for k, w in weights.items()}


def _spec(**changes):
    return lambda spec, weights: (dataclasses.replace(spec, **changes), weights)


def _without_sandwich_norms(spec, weights):
    kept = {k: w for k, w in weights.items() if "feedforward_layernorm" not in k}
    return dataclasses.replace(spec, sandwich_norms=False), kept


def _without_qk_norm(spec, weights):
    return dataclasses.replace(spec, qk_norm=False), {k: w for k, w in weights.items() if "_norm." not in k}


MUTATIONS = {
    "gemma2-norm-plus-one": ("gemma2", _norms_without_plus_one),
    "gemma2-embedding-scale": ("gemma2", _spec(embedding_scale=1.0)),
    "gemma2-sandwich-norms": ("gemma2", _without_sandwich_norms),
    "gemma2-geglu": ("gemma2", _spec(hidden_act="silu")),
    "gemma2-attention-softcap": ("gemma2", _spec(attn_logit_softcap=0.0)),
    "gemma2-final-softcap": ("gemma2", _spec(final_logit_softcap=0.0)),
    "gemma2-no-window": ("gemma2", _spec(layer_types=(), sliding_window=0)),
    "gemma2-window-everywhere": ("gemma2", _spec(layer_types=())),
    "gemma3-norm-plus-one": ("gemma3", _norms_without_plus_one),
    "gemma3-qk-norm": ("gemma3", _without_qk_norm),
    "gemma3-local-rope-base": ("gemma3", _spec(rope_local_theta=0.0)),
    "gemma3-window-everywhere": ("gemma3", _spec(layer_types=())),
    "gemma3-4b-query-pre-attn-scalar": ("gemma3-4b", _spec(query_pre_attn_scalar=0.0)),
    "gemma3-4b-linear-scaling": ("gemma3-4b", _spec(rope_scaling=None)),
}


@pytest.mark.parametrize("case", list(MUTATIONS))
def test_each_gemma_piece_matters(tmp_path, case):
    from transformers import AutoModelForCausalLM

    family, remove = MUTATIONS[case]
    folder = make_tiny_hf_model(tmp_path, family)
    ckpt = load_checkpoint(folder)
    spec, weights = remove(ckpt.spec, dict(ckpt.weights))
    input_ids = torch.randint(0, spec.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(40)[None]  # five windows of 8: every sliding layer masks
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(input_ids=input_ids, position_ids=position_ids).logits
        intact = ReferenceModel.from_checkpoint(ckpt)(input_ids, position_ids)
        mutated = ReferenceModel(spec, weights)(input_ids, position_ids)
    torch.testing.assert_close(intact, want, atol=1e-4, rtol=1e-4)
    assert (mutated - want).abs().max() > 1e-3  # Gemma 2's attention cap of 50 moves tiny logits least: ~6e-3


def test_gemma_configs_parse_like_transformers():
    """Layer types, soft-caps, scales and the local RoPE base as transformers' Gemma classes read them, from
    config.json shapes of the hub's releases (older keys: sliding_window_pattern, rope_local_base_freq)."""
    gemma2 = {"architectures": ["Gemma2ForCausalLM"], "hidden_size": 2304, "intermediate_size": 9216,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
              "vocab_size": 256000, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
              "query_pre_attn_scalar": 144, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
              "sliding_window": 4096, "rope_theta": 10000.0}
    spec = ModelSpec.from_hf_config(gemma2)
    assert spec.layer_types == ("sliding_attention", "full_attention") * 2 and spec.tie_word_embeddings
    assert [spec.layer_window(i) for i in range(4)] == [4096, 0, 4096, 0] and spec.kv_window == 0
    assert (spec.attn_logit_softcap, spec.final_logit_softcap, spec.query_pre_attn_scalar) == (50.0, 30.0, 144.0)
    assert spec.embedding_scale == 48.0 and spec.hidden_act == "gelu_tanh" and not spec.qk_norm
    gemma3 = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 12, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 262208, "query_pre_attn_scalar": 256,
        "sliding_window": 1024, "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "attn_logit_softcapping": None}}
    from kiln.export.gemma_weights import text_config

    spec = ModelSpec.from_hf_config(text_config(gemma3))
    assert spec.family == "gemma3" and spec.qk_norm and spec.eos_token_ids == (1, 106)
    assert [i for i in range(12) if not spec.layer_window(i)] == [5, 11]
    assert [i for i in range(12) if spec.uses_local_rope(i)] == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]
    assert spec.rope_theta == 1e6 and spec.rope_local_theta == 1e4 and spec.rope_scaling.factor == 8.0
    assert spec.attn_logit_softcap == 0.0 and spec.final_logit_softcap == 0.0
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelSpec.from_hf_config({**gemma2, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="hidden_activation 'relu'"):
        ModelSpec.from_hf_config({**gemma2, "hidden_act": "relu", "hidden_activation": "relu"})


def test_gemma3_conditional_generation_compiles_its_text_part(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (a tiny SigLIP tower beside the tiny Gemma-3-1B text model):
    kiln reads the text decoder's weights and config and gives transformers' text-only logits."""
    from helpers import _randomize, tiny_hf_config, write_tiny_tokenizer
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    config = Gemma3Config(text_config=tiny_hf_config("gemma3").to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, image_token_index=300, boi_token_index=301, eoi_token_index=302)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    _randomize(model.model.language_model, 0)
    folder = tmp_path / "gemma3-mm"
    model.save_pretrained(folder)
    write_tiny_tokenizer(folder)
    ckpt = load_checkpoint(folder)
    assert ckpt.spec.family == "gemma3" and not any("vision" in name for name in ckpt.weights)
    input_ids = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(1))
    position_ids = torch.arange(30)[None]
    with torch.no_grad():
        ours = ReferenceModel.from_checkpoint(ckpt)(input_ids, position_ids)
        hf = Gemma3ForConditionalGeneration.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
        want = hf.eval()(input_ids=input_ids, position_ids=position_ids).logits
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gguf_engine_matches_transformers(tmp_path, family):
    """The GGUF written like llama.cpp's converter (norms stored with the 1 added) builds to an engine whose
    packed, chunked, past-the-window steps equal transformers on the Hugging Face checkpoint it came from."""
    from test_engine_numerics import SHORT_PROMPTS, check_against_transformers
    from tiny_gguf import make_tiny_gguf

    from kiln.manifest import BuildOptions
    from kiln.optimize.build import build_engine

    gguf_path, hf_dir = make_tiny_gguf(tmp_path, family)
    build_engine(gguf_path, tmp_path / "engine", BuildOptions(kv_dtype="float32"), progress=lambda _msg: None)
    check_against_transformers(tmp_path / "engine", hf_dir, SHORT_PROMPTS, steps=6, atol=1e-4)
