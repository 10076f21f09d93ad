"""benchmarks/scale/checkpoints.py's random GGUFs: Q4_K_M's per-tensor mix as llama.cpp's quantizer chooses it, and
the olmoe architecture as gguf-py reads it back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from helpers import load_script, write_tiny_tokenizer
from tiny_gguf import _add_tiny_gguf_tokenizer

checkpoints = load_script(Path(__file__).resolve().parents[2] / "benchmarks" / "scale" / "checkpoints.py",
                          "scale_checkpoints")


def test_q4_k_m_keeps_attn_v_and_ffn_down_at_q6_k_in_llama_cpps_layers():
    tensors = checkpoints.gguf_tensors(checkpoints.SHAPES["llama-3.1-8b"])
    # llama.cpp's use_more_bits for 32 layers: the first and last 4, and every third from layer 6
    more_bits = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    for part in ("attn_v", "ffn_down"):
        assert [i for i in range(32) if tensors[f"blk.{i}.{part}.weight"][1] == "Q6_K"] == more_bits
    assert {tensors[f"blk.{i}.{part}.weight"][1] for i in range(32)
            for part in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} == {"Q4_K"}
    assert tensors["output.weight"][1] == "Q6_K" and tensors["token_embd.weight"][1] == "Q4_K"
    assert tensors["blk.0.attn_norm.weight"][1] == "F32"


def test_an_olmoe_gguf_has_projection_wide_qk_norms_and_float32_routers(tmp_path):
    import gguf

    shape = checkpoints.Shape("olmoe", 256, 8, 4, 2, 256, tied=False, rope_theta=10000.0, vocab=512, experts=4,
                              top_k=2)
    (tmp_path / "tok").mkdir()
    write_tiny_tokenizer(tmp_path / "tok")
    path = tmp_path / "olmoe.gguf"
    checkpoints.write_random_gguf(shape, path, lambda w: _add_tiny_gguf_tokenizer(w, tmp_path / "tok", 512))

    reader = gguf.GGUFReader(str(path))
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "olmoe"
    assert int(reader.fields["olmoe.expert_count"].parts[-1][0]) == 4
    types = {t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape)) for t in reader.tensors}
    assert types["blk.0.attn_q_norm.weight"] == ("F32", (256,))  # over the whole q projection (4 heads of 64)
    assert types["blk.0.attn_k_norm.weight"] == ("F32", (128,))  # 2 KV heads of 64
    assert types["blk.0.ffn_gate_inp.weight"][0] == "F32"
    assert types["blk.0.ffn_down_exps.weight"][0] == "Q6_K"  # layer 0 of 8 is one use_more_bits picks
    assert types["blk.1.ffn_down_exps.weight"][0] == "Q4_K"
    router = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_inp.weight")
    assert np.isfinite(router.data).all()
