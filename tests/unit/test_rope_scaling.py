"""RoPE scalings against transformers' rotary embedding classes, at positions up to 32k.

kiln folds rope scaling into the frequencies at export (export/reference.py) and the build turns them into the
op's cos/sin tables (optimize/rotary.py); the attention factor of YaRN and LongRoPE multiplies cos and sin in
transformers and, for a fully rotated head, the softmax scale in kiln (the same q.k). Each case parses a
config.json as a checkpoint ships it, builds the tables kiln's engine reads, and compares them with the cos/sin
transformers computes for the same positions: around the original context and up to 32k. Every case also
checks that plain RoPE differs there, so the comparison fails when the scaling is dropped.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kiln.export.reference import rope_attention_factor, rope_inv_freq
from kiln.optimize.rotary import rotary_tables
from kiln.spec import ModelSpec

HEAD_DIM = 128
BASE = dict(vocab_size=256, hidden_size=HEAD_DIM * 4, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, rms_norm_eps=1e-6)
QWEN25_YARN = dict(BASE, architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0,
                   max_position_embeddings=32768,
                   rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
# Qwen3's long-context recipe: a YaRN factor over a shorter original context than max_position_embeddings
QWEN3_YARN = dict(BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_theta=1000000.0,
                  max_position_embeddings=40960,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192})
LLAMA32 = dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=500000.0,
               max_position_embeddings=131072,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192})
LINEAR = dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=10000.0,
              max_position_embeddings=4096, rope_scaling={"type": "linear", "factor": 8.0})
DYNAMIC = dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=10000.0,
               max_position_embeddings=4096, rope_scaling={"type": "dynamic", "factor": 8.0})
PHI35 = dict(BASE, architectures=["Phi3ForCausalLM"], model_type="phi3", rope_theta=10000.0,
             num_key_value_heads=4, max_position_embeddings=131072, original_max_position_embeddings=4096,
             rope_scaling={"type": "longrope",
                           "short_factor": [1.0 + 0.002 * i for i in range(HEAD_DIM // 2)],
                           "long_factor": [1.0 + 59.0 * (i / (HEAD_DIM // 2 - 1)) ** 2 for i in range(HEAD_DIM // 2)]})


def around(original: int) -> list[int]:
    """Positions at the start, around the original context and on up to 32k."""
    near = [original - 1, original, original + 1]
    return sorted({0, 1, 100, 4095, 8191, 16384, 32767, *(p for p in near if p < 32768)})


def transformers_cos_sin(config: dict, positions: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [len(positions), D] from the family's rotary embedding class, for one sequence at these positions."""
    import transformers

    cls = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama", "phi3": "Phi3"}[config["model_type"]]
    hf_config = getattr(transformers, f"{cls}Config")(**{k: v for k, v in config.items() if k != "model_type"})
    module = __import__(f"transformers.models.{config['model_type']}.modeling_{config['model_type']}",
                        fromlist=[f"{cls}RotaryEmbedding"])
    rope = getattr(module, f"{cls}RotaryEmbedding")(hf_config)
    with torch.no_grad():
        cos, sin = rope(torch.zeros(1, dtype=torch.float32), torch.tensor([positions]))
    return cos[0].numpy(), sin[0].numpy()


def kiln_cos_sin(spec: ModelSpec, positions: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The rows of the engine's cos/sin tables at these positions, times the attention factor, as [P, D/2]."""
    cos, sin = rotary_tables(rope_inv_freq(spec).numpy(), max(positions) + 1)
    factor = np.float32(rope_attention_factor(spec))
    return cos[positions] * factor, sin[positions] * factor


def check(config: dict, context: int, positions: list[int]) -> None:
    spec = ModelSpec.from_hf_config(config).for_context(context)
    want_cos, want_sin = transformers_cos_sin(config, positions)
    half = HEAD_DIM // 2
    np.testing.assert_array_equal(want_cos[:, :half], want_cos[:, half:])  # rotate_half: both halves alike
    got_cos, got_sin = kiln_cos_sin(spec, positions)
    np.testing.assert_allclose(got_cos, want_cos[:, :half], rtol=0, atol=2e-6)
    np.testing.assert_allclose(got_sin, want_sin[:, :half], rtol=0, atol=2e-6)
    plain_cos, _ = kiln_cos_sin(dataclasses.replace(spec, rope_scaling=None), positions)
    assert np.abs(plain_cos - want_cos[:, :half]).max() > 0.1, "the scaling changes nothing at these positions"


@pytest.mark.parametrize("config", [QWEN25_YARN, QWEN3_YARN, LLAMA32, LINEAR],
                         ids=["qwen2.5-yarn", "qwen3-yarn", "llama3.2", "linear"])
def test_static_scalings_match_transformers(config):
    original = config["rope_scaling"].get("original_max_position_embeddings", config["max_position_embeddings"])
    check(config, context=32768, positions=around(original))


def test_yarn_attention_factor_is_transformers_default():
    spec = ModelSpec.from_hf_config(QWEN25_YARN)
    assert spec.rope_scaling is not None and spec.rope_scaling.rope_type == "yarn"
    assert rope_attention_factor(spec) == pytest.approx(0.1 * np.log(4.0) + 1.0)
    given = dict(QWEN25_YARN, rope_scaling=dict(QWEN25_YARN["rope_scaling"], attention_factor=1.25))
    check(given, context=32768, positions=around(32768))


@pytest.mark.parametrize("context", [4096, 16384, 32768])
def test_dynamic_ntk_matches_transformers_at_the_engine_context(context):
    """transformers stretches dynamic NTK's base for the sequence at hand (its longest position + 1); an engine
    fixes it at its context, so a sequence reaching the engine's last position gets the same cos/sin."""
    positions = sorted({p for p in around(4096) if p < context} | {context - 1})
    if context == 4096:  # within the original context: plain RoPE, as transformers
        spec = ModelSpec.from_hf_config(DYNAMIC).for_context(context)
        want_cos, _ = transformers_cos_sin(DYNAMIC, positions)
        np.testing.assert_allclose(kiln_cos_sin(spec, positions)[0], want_cos[:, :HEAD_DIM // 2], atol=2e-6)
        return
    check(DYNAMIC, context=context, positions=positions)


@pytest.mark.parametrize("context", [4096, 32768])
def test_longrope_matches_transformers(context):
    """Phi-3.5's LongRoPE: the short factors for an engine within the original 4k, the long ones beyond (a
    sequence reaching past the original context: transformers then uses the long set for every position)."""
    positions = [p for p in around(4096) if p < context] + ([context - 1] if context > 32767 else [])
    check(PHI35, context=context, positions=sorted(set(positions)))


@pytest.mark.parametrize("config, context_length", [
    (QWEN25_YARN, 131072), (QWEN3_YARN, 40960), (LLAMA32, 131072), (LINEAR, 32768), (DYNAMIC, 32768),
    (PHI35, 131072), (dict(BASE, architectures=["LlamaForCausalLM"], rope_theta=1e4, max_position_embeddings=8192),
                      8192),
], ids=["qwen2.5-yarn", "qwen3-yarn", "llama3.2", "linear", "dynamic", "longrope", "plain"])
def test_context_length_is_the_scaled_one(config, context_length):
    assert ModelSpec.from_hf_config(config).context_length == context_length


def test_unknown_rope_type_is_named():
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'su2'.*'yarn'"):
        ModelSpec.from_hf_config(dict(LINEAR, rope_scaling={"type": "su2", "factor": 2.0}))
