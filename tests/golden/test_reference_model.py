"""ReferenceModel numerics against transformers: tiny random models of every family, the
GGUF path, and (slow) SmolLM2-135M-Instruct from its GGUF, tokenizer and chat template included."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import load_hf_reference, make_tiny_hf_model
from tiny_gguf import make_tiny_gguf

from kiln.export import ReferenceModel, default_model_path, load_checkpoint
from kiln.export.reference import attention_scale, rope_inv_freq

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}

TINY_CASES = {
    "llama-gqa-tied": ("llama", {}),
    "llama-mha-untied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "llama-mqa": ("llama", dict(num_key_value_heads=1)),
    "llama3-rope-scaling": ("llama", dict(rope_scaling=LLAMA3_SCALING, rope_theta=500000.0)),
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama-head-dim-32": ("llama", dict(head_dim=32)),
    "mistral-sliding-window": ("mistral", dict(sliding_window=5, num_key_value_heads=1)),
    "qwen2-bias-untied": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen3-qk-norm-tied": ("qwen3", {}),
    "qwen3-qk-norm-untied": ("qwen3", dict(tie_word_embeddings=False)),
    "phi3-fused-longrope": ("phi3", {}),
    "phi3-no-rope-scaling": ("phi3", dict(rope_scaling=None, max_position_embeddings=32)),
    "phi4-partial-rotary-longrope": ("phi4", {}),
    "gemma2-softcaps-alternating-window": ("gemma2", {}),
    "gemma3-1b-local-rope-qk-norm": ("gemma3", {}),
    "gemma3-4b-linear-rope-scalar": ("gemma3-4b", {}),
}


def _hf_logits(folder, input_ids, position_ids):
    model = load_hf_reference(folder)
    with torch.no_grad():
        return model(input_ids=input_ids, position_ids=position_ids).logits


def _positions(batch: int, seq: int, offsets=(0, 9)) -> torch.Tensor:
    return torch.stack([torch.arange(seq) + offsets[b % len(offsets)] for b in range(batch)])


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_tiny_models_match_transformers(tmp_path, case):
    family, overrides = TINY_CASES[case]
    folder = make_tiny_hf_model(tmp_path, family, **overrides)
    model = ReferenceModel.from_checkpoint(load_checkpoint(folder))
    torch.manual_seed(0)
    input_ids = torch.randint(0, model.spec.vocab_size, (2, 13))
    position_ids = _positions(2, 13)
    with torch.no_grad():
        ours = model(input_ids, position_ids)
    assert ours.shape == (2, 13, model.spec.vocab_size) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, _hf_logits(folder, input_ids, position_ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["phi3", "phi4"])
def test_longrope_factor_set_follows_the_context(tmp_path, family):
    """LongRoPE: a context within the original one uses the short factors, a longer one the long factors,
    each equal to transformers on sequences of that kind (transformers picks by the sequence's length)."""
    folder = make_tiny_hf_model(tmp_path, family)
    ckpt = load_checkpoint(folder)
    original = ckpt.spec.rope_scaling.original_max_position_embeddings
    for length, context in ((original - 5, original), (original + 20, ckpt.spec.max_position_embeddings)):
        spec = ckpt.spec.for_context(context)
        assert spec.rope_scaling.long_context == (context > original)
        input_ids = torch.randint(0, spec.vocab_size, (1, length))
        position_ids = torch.arange(length)[None]
        with torch.no_grad():
            ours = ReferenceModel(spec, ckpt.weights)(input_ids, position_ids)
        torch.testing.assert_close(ours, _hf_logits(folder, input_ids, position_ids), atol=1e-4, rtol=1e-4)


def _without_qk_norm(spec, weights):
    return dataclasses.replace(spec, qk_norm=False), {k: v for k, v in weights.items() if "_norm." not in k}


def _switch_longrope_set(spec, weights):
    scaling = dataclasses.replace(spec.rope_scaling, long_context=not spec.rope_scaling.long_context)
    return dataclasses.replace(spec, rope_scaling=scaling), weights


def _without_attention_factor(spec, weights):
    return dataclasses.replace(spec, rope_scaling=dataclasses.replace(spec.rope_scaling, attention_factor=1.0)), weights


def _full_rotary(spec, weights):
    scaling = spec.rope_scaling
    pairs = spec.head_dim // 2  # the factor lists must cover every pair once the whole head rotates
    scaling = dataclasses.replace(scaling, short_factor=scaling.short_factor[:1] * pairs,
                                  long_factor=scaling.long_factor[:1] * pairs)
    return dataclasses.replace(spec, rotary_dim=0, rope_scaling=scaling), weights


@pytest.mark.parametrize("family, remove", [
    ("qwen3", _without_qk_norm),
    ("phi3", _switch_longrope_set),
    ("phi3", _without_attention_factor),
    ("phi4", _switch_longrope_set),
    ("phi4", _without_attention_factor),
    ("phi4", _full_rotary),
], ids=["qwen3-qk-norm", "phi3-longrope-set", "phi3-attention-factor", "phi4-longrope-set",
        "phi4-attention-factor", "phi4-partial-rotary"])
def test_each_family_piece_matters(tmp_path, family, remove):
    """Without the piece, the tiny model's logits leave transformers' by far more than the parity tolerance,
    so the parity tests above fail when a family-specific piece is dropped."""
    folder = make_tiny_hf_model(tmp_path, family)
    ckpt = load_checkpoint(folder)
    length = 40  # past the tiny Phi models' original context of 32: transformers uses the long factors
    spec, weights = remove(ckpt.spec.for_context(ckpt.spec.max_position_embeddings), ckpt.weights)
    input_ids = torch.randint(0, spec.vocab_size, (1, length))
    position_ids = torch.arange(length)[None]
    with torch.no_grad():
        ours = ReferenceModel(spec, weights)(input_ids, position_ids)
    assert (ours - _hf_logits(folder, input_ids, position_ids)).abs().max() > 0.05


def test_causal_mask_follows_positions():
    """mask[b, 0, i, j] = 0 iff pos[j] <= pos[i] (and pos[i] - pos[j] < window), else MASK_VALUE."""
    from kiln.export.reference import MASK_VALUE, causal_mask

    pos = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    full = causal_mask(pos)
    assert full.shape == (2, 1, 4, 4)
    expected = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    assert torch.equal(full[:, 0] == 0, expected.expand(2, 4, 4))
    assert torch.all(full[:, 0][~expected.expand(2, 4, 4)] == MASK_VALUE)
    window = causal_mask(pos, sliding_window=2)[0, 0] == 0
    assert window.tolist() == [[True, False, False, False], [True, True, False, False],
                               [False, True, True, False], [False, False, True, True]]
    # Order in the row does not matter, only the positions.
    shuffled = causal_mask(torch.tensor([[2, 0, 1]]))[0, 0] == 0
    assert shuffled.tolist() == [[True, True, True], [False, True, False], [False, True, True]]


def test_single_token_and_continuation_positions(tmp_path):
    """S=1 works, and the last row of a prefix equals a prefix run (causality)."""
    folder = make_tiny_hf_model(tmp_path, "llama")
    model = ReferenceModel.from_checkpoint(load_checkpoint(folder))
    ids = torch.randint(0, 320, (1, 9))
    with torch.no_grad():
        full = model(ids, torch.arange(9)[None])
        prefix = model(ids[:, :4], torch.arange(4)[None])
        one = model(ids[:, :1], torch.zeros(1, 1, dtype=torch.long))
    torch.testing.assert_close(full[:, :4], prefix, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full[:, :1], one, atol=1e-5, rtol=1e-5)


def test_parameters_carry_hf_names(tmp_path):
    ckpt = load_checkpoint(make_tiny_hf_model(tmp_path, "qwen2", tie_word_embeddings=False))
    model = ReferenceModel.from_checkpoint(ckpt)
    assert set(model.state_dict()) == set(ckpt.weights)
    # The checkpoint's weights are read from their file when asked for: the model holds the same numbers.
    assert torch.equal(model.model.embed_tokens.weight, ckpt.weights["model.embed_tokens.weight"])


GGUF_CASES = {
    "mqa-untied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=False)),
    "llama3-rope-freqs": ("llama", dict(rope_scaling=LLAMA3_SCALING, num_key_value_heads=4)),
    "linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
    "qwen3-untied": ("qwen3", dict(tie_word_embeddings=False)),
    "phi3-longrope": ("phi3", {}),
    "phi4-partial-rotary": ("phi4", {}),
    "qwen2-yarn": ("qwen2", dict(max_position_embeddings=32, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})),
    "gemma2-norm-plus-one": ("gemma2", {}),
    "gemma3-norm-plus-one": ("gemma3", {}),
    # GGUF does not store query_pre_attn_scalar: llama.cpp (and kiln) take head_dim but for the 27B models
    "gemma3-4b-linear-rope": ("gemma3-4b", dict(query_pre_attn_scalar=128)),
    "mixtral-experts": ("mixtral", {}),
    "qwen2moe-shared-expert": ("qwen2_moe", {}),
    "qwen3moe": ("qwen3_moe", {}),
    "olmoe": ("olmoe", {}),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_tiny_gguf_matches_transformers(tmp_path, case):
    """A GGUF converted as llama.cpp does loads to the HF checkpoint's spec and the same logits."""
    family, overrides = GGUF_CASES[case]
    gguf_path, hf_dir = make_tiny_gguf(tmp_path, family, **overrides)
    ckpt, hf_ckpt = load_checkpoint(gguf_path), load_checkpoint(hf_dir)
    assert dataclasses.replace(ckpt.spec, rope_scaling=None) == dataclasses.replace(hf_ckpt.spec, rope_scaling=None)
    # The rope scaling may differ in how it is spelled (llama3 recovered from rope_freqs, LongRoPE factors
    # rounded to float32), never in the frequencies or the attention factor.
    for context in (32, 128):
        ours, theirs = ckpt.spec.for_context(context), hf_ckpt.spec.for_context(context)
        torch.testing.assert_close(rope_inv_freq(ours), rope_inv_freq(theirs), rtol=1e-6, atol=0)
        assert attention_scale(ours) == pytest.approx(attention_scale(theirs), rel=1e-6)
    model = ReferenceModel.from_checkpoint(ckpt)
    input_ids = torch.randint(0, 320, (2, 11))
    # within the tiny Phi models' original context (32), where transformers uses the short factors, as the spec
    position_ids = _positions(2, 11, offsets=(0, 9 if family.startswith("phi") else 40))
    with torch.no_grad():
        ours = model(input_ids, position_ids)
    torch.testing.assert_close(ours, _hf_logits(hf_dir, input_ids, position_ids), atol=1e-4, rtol=1e-4)


# --- SmolLM2-135M-Instruct (GGUF) -------------------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away, there lived a",
]
TOKENIZER_TEXTS = PROMPTS + [
    "", " leading space and  double  spaces", "Ünïcödé ✓ 日本語 🤖", "<|im_start|>user\nHi!<|im_end|>\n",
    "numbers 1234567 and 3.14159", "tabs\tand\nnewlines\r\n",
]
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}],
]


def _smollm2_path():
    try:
        return default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    return load_checkpoint(_smollm2_path())


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' own GGUF path: its config, its tensor mapping and q/k un-permutation.
    (from_pretrained(gguf_file=) would need accelerate; load_gguf_checkpoint does the same work.)"""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = _smollm2_path()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys  # tied
    model.tie_weights()
    return model


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer():
    from transformers import AutoTokenizer

    path = _smollm2_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.slow
def test_smollm2_spec(smollm2_checkpoint):
    spec = smollm2_checkpoint.spec
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 576, 9, 3, 64)
    assert (spec.vocab_size, spec.intermediate_size, spec.tie_word_embeddings) == (49152, 1536, True)
    assert (spec.rope_theta, spec.rms_norm_eps, spec.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert spec.bos_token_id == 1 and spec.eos_token_ids == (2,)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2_checkpoint, smollm2_hf, smollm2_hf_tokenizer):
    hf_model, tokenizer = smollm2_hf, smollm2_hf_tokenizer
    model = ReferenceModel.from_checkpoint(smollm2_checkpoint)
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        pos = torch.arange(ids.shape[1])[None]
        with torch.no_grad():
            ours = model(ids, pos)
            theirs = hf_model(input_ids=ids, position_ids=pos).logits
        torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-3, msg=prompt)
    ids = torch.tensor([tokenizer("The capital of France is")["input_ids"]])
    with torch.no_grad():
        top = model(ids, torch.arange(ids.shape[1])[None])[0, -1].argmax()
    assert tokenizer.decode(top).strip() == "Paris"


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2_checkpoint, smollm2_hf_tokenizer):
    from tokenizers import Tokenizer

    reference = smollm2_hf_tokenizer
    ours = Tokenizer.from_str(smollm2_checkpoint.tokenizer.tokenizer_json)
    for text in TOKENIZER_TEXTS:
        ids = ours.encode(text).ids
        assert ids == reference(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids), text


@pytest.mark.slow
def test_smollm2_chat_template_renders(smollm2_checkpoint, smollm2_hf_tokenizer):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    reference = smollm2_hf_tokenizer
    config = smollm2_checkpoint.tokenizer.tokenizer_config
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    # transformers renders chat templates with trim_blocks and lstrip_blocks.
    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(config["chat_template"])
    for messages in MESSAGES:
        text = template.render(messages=messages, add_generation_prompt=True,
                               bos_token=config["bos_token"], eos_token=config["eos_token"])
        assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n") and messages[-1]["content"] in text
