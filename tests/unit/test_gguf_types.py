"""GGUF tensors read tensor by tensor (export/tensor_files.py) equal gguf-py's dequantize bit for bit, for every
block type a llama.cpp file carries and in a file that mixes them per tensor (as Q4_K_M keeps some in Q6_K)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_tiny_hf_model
from tiny_gguf import llama_cpp_permute

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from kiln.export import load_checkpoint  # noqa: E402
from kiln.export.tensor_files import GgufTensor  # noqa: E402

# Byte offsets of each block's float16 scales (d, dmin): random bytes there could be NaN or inf.
_F16_FIELDS = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
BLOCK_TYPES = tuple(_F16_FIELDS)


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks of qtype for a [rows, cols] tensor: random bytes, finite float16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in _F16_FIELDS[qtype]:
        scale = rng.uniform(-0.05, 0.05, (rows, cols // block)).astype(np.float16)
        data[..., offset:offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def tensor_bytes(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    if qtype in FLOAT_TYPES:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    return random_blocks(qtype, rows, cols, rng)


def write_gguf(path, tensors: dict[str, tuple[Q, np.ndarray]], arch: str = "llama") -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    for name, (qtype, data) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_py(path) -> dict[str, np.ndarray]:
    """gguf-py's own reading of every tensor: its reader's data through its dequantize."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            for t in reader.tensors}


def kiln_sources(path) -> dict[str, GgufTensor]:
    reader = gguf.GGUFReader(str(path))
    return {t.name: GgufTensor(path, int(t.data_offset), int(t.n_bytes), int(t.tensor_type),
                               tuple(int(d) for d in reversed(t.shape.tolist()))) for t in reader.tensors}


@pytest.mark.parametrize("qtype", FLOAT_TYPES + BLOCK_TYPES, ids=lambda q: q.name)
def test_each_type_reads_as_gguf_py_dequantizes_it(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    path = tmp_path / f"{qtype.name}.gguf"
    write_gguf(path, {"t.weight": (qtype, tensor_bytes(qtype, 6, 512, rng))})
    expected = gguf_py(path)["t.weight"]
    got = kiln_sources(path)["t.weight"].read()
    assert got.dtype == torch.float32 and tuple(got.shape) == (6, 512)
    assert np.isfinite(expected).all()
    np.testing.assert_array_equal(got.numpy().view(np.uint32), expected.astype(np.float32).view(np.uint32))


def test_rows_are_dequantized_in_slabs_without_changing_a_bit(tmp_path, monkeypatch):
    """A tensor larger than one slab is dequantized a slab of rows at a time: the same bits as all at once."""
    monkeypatch.setattr("kiln.export.tensor_files._SLAB_BYTES", 3 * 4 * 256)  # 3 rows of 256 floats per slab
    rng = np.random.default_rng(7)
    path = tmp_path / "slabs.gguf"
    write_gguf(path, {"a.weight": (Q.Q6_K, random_blocks(Q.Q6_K, 10, 256, rng)),
                      "b.weight": (Q.Q4_1, random_blocks(Q.Q4_1, 10, 256, rng))})
    expected = gguf_py(path)
    for name, source in kiln_sources(path).items():
        np.testing.assert_array_equal(source.read().numpy(), expected[name])


def write_llama_gguf(tmp_path, types) -> tuple:
    """A 2-layer llama GGUF whose matrices take their types from the iterator `types` (norms F32), random valid
    blocks; returns (path, {gguf name: hf name}, spec)."""
    from tiny_gguf import _add_tiny_gguf_tokenizer

    from kiln.export.checkpoint_types import expected_weight_shapes

    hf_dir = make_tiny_hf_model(tmp_path, "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                num_key_value_heads=2, tie_word_embeddings=False)
    spec = load_checkpoint(hf_dir).spec
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    rng = np.random.default_rng(3)
    path = tmp_path / "mixed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(spec.num_layers)
    writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_vocab_size(spec.vocab_size)
    _add_tiny_gguf_tokenizer(writer, hf_dir, spec.vocab_size)
    hf_of = {}
    for hf_name, shape in expected_weight_shapes(spec).items():
        if hf_name.startswith("model.layers."):
            _, _, layer, rest = hf_name.split(".", 3)
            gguf_name = f"blk.{layer}.{parts[rest.rsplit('.', 1)[0]]}.weight"
        else:
            gguf_name = globals_[hf_name]
        if len(shape) == 1:
            writer.add_tensor(gguf_name, rng.standard_normal(shape).astype(np.float32))
        else:
            qtype = next(types)
            data = tensor_bytes(qtype, *shape, rng) if qtype in FLOAT_TYPES or qtype in _F16_FIELDS else \
                rng.integers(0, 256, (shape[0], shape[1] // 256 * GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        hf_of[gguf_name] = hf_name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, hf_of, spec


def test_a_mixed_type_llama_loads_as_gguf_py_reads_it(tmp_path):
    """A llama GGUF whose matrices are each of a different type (K-quants, legacy quants, IQ4, floats) loads
    tensor by tensor to gguf-py's numbers, q/k rows unpermuted, under Hugging Face names."""
    all_types = BLOCK_TYPES + (Q.F16, Q.BF16)
    path, hf_of, spec = write_llama_gguf(tmp_path, iter(all_types * 4))
    checkpoint = load_checkpoint(path)
    expected = gguf_py(path)
    reader = gguf.GGUFReader(str(path))
    assert {Q(int(t.tensor_type)) for t in reader.tensors} >= set(all_types)
    assert sorted(checkpoint.weights) == sorted(hf_of.values())
    for gguf_name, hf_name in hf_of.items():
        want = expected[gguf_name].astype(np.float32)
        got = checkpoint.weights[hf_name].numpy()
        if gguf_name.endswith(("attn_q.weight", "attn_k.weight")):  # kiln undoes llama.cpp's permutation
            got = llama_cpp_permute(got, spec.num_heads if "attn_q" in gguf_name else spec.num_kv_heads)
        np.testing.assert_array_equal(got.reshape(want.shape), want)


def test_a_type_gguf_py_cannot_dequantize_is_named(tmp_path):
    path, _, _ = write_llama_gguf(tmp_path, iter([Q.Q8_K] + [Q.Q4_0] * 100))
    with pytest.raises(ValueError, match=r"mixed\.gguf: tensor \S+ is Q8_K, which gguf-py cannot dequantize"):
        load_checkpoint(path)
