"""Golden: the mixture-of-experts families (kiln.MoE) built into engines, against transformers.

Each tiny random model (tests/helpers.py: the real configs' routing, shrunk) is built in fp32 and decoded on packed
ragged steps (prefill chunks mixed with decodes); every logits row must equal transformers' within 1e-4 and greedy
tokens must agree. The same engine with its routing perturbed (top_k off by one, the renormalisation flag flipped,
the experts' order reversed against the router's) must fail that comparison: the check sees the routing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx
import pytest
from test_engine_numerics import SHORT_PROMPTS, check_against_transformers

from kiln.moe import OP_TYPE

FAMILIES = ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"]


def moe_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [node for node in model.graph.node if node.op_type == OP_TYPE and node.domain == "kiln"]


def perturbed_copy(engine: Path, out: Path, how: str) -> Path:
    """A copy of the engine's graph with every kiln.MoE's routing perturbed `how`."""
    out.mkdir(parents=True)
    shutil.copy(engine / "tokenizer.json", out / "tokenizer.json")
    model = onnx.load(str(engine / "model.onnx"))  # with its external weights: the tiny model is small
    initializers = {init.name: init for init in model.graph.initializer}
    for node in moe_nodes(model):
        attrs = {a.name: a for a in node.attribute}
        if how == "top_k+1":
            attrs["top_k"].i += 1
        elif how == "top_k-1":
            attrs["top_k"].i -= 1
        elif how == "renormalisation":
            attrs["norm_topk_prob"].i = 1 - attrs["norm_topk_prob"].i
        else:  # expert order: the stacked experts reversed, the router's rows not
            for name in node.input[2:4]:
                init = initializers[name]
                init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init)[::-1].copy(), name))
    onnx.save(model, str(out / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_family_matches_transformers_and_sees_its_routing(tmp_path, family):
    """The family's tiny model built in fp32 equals transformers; each perturbed routing does not."""
    from helpers import make_tiny_hf_model

    from kiln.manifest import BuildOptions
    from kiln.optimize.build import build_engine

    model = make_tiny_hf_model(tmp_path, family=family)
    engine = tmp_path / "engine"
    build_engine(model, engine, BuildOptions(kv_dtype="float32"), progress=lambda _msg: None)
    graph = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    # one per layer, each reading its own layer's router: the experts' loop traced into the op
    assert [node.input[1] for node in moe_nodes(graph)] == [f"model.layers.{i}.mlp.gate.weight" for i in range(2)]
    check_against_transformers(engine, model, SHORT_PROMPTS, steps=6, atol=1e-4)

    top_k = next(a.i for a in moe_nodes(graph)[0].attribute if a.name == "top_k")
    for how in ("top_k+1", "top_k-1" if top_k > 1 else None, "renormalisation", "expert order"):
        if how is None:
            continue
        wrong = perturbed_copy(engine, tmp_path / how.replace(" ", "_"), how)
        with pytest.raises(AssertionError):
            check_against_transformers(wrong, model, SHORT_PROMPTS, steps=2, atol=1e-4)


def test_moe_spec_rejects_partly_dense_configs(tmp_path):
    """Qwen-MoE configs with dense layers among the sparse ones are refused by name, not compiled wrong."""
    from kiln.spec import ModelSpec

    config = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
              "moe_intermediate_size": 4, "num_hidden_layers": 2, "num_attention_heads": 2, "num_experts": 4,
              "num_experts_per_tok": 2, "mlp_only_layers": [1]}
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelSpec.from_hf_config(config)
    spec = ModelSpec.from_hf_config({**config, "mlp_only_layers": []})
    assert (spec.num_experts, spec.experts_per_token, spec.intermediate_size) == (4, 2, 4)


def test_mixtral_gguf_engine_matches_transformers(tmp_path):
    """llama.cpp's layout of Mixtral (general.architecture llama, stacked ffn_*_exps, permuted q/k rows) builds
    into the engine the Hugging Face checkpoint gives."""
    from tiny_gguf import make_tiny_gguf

    from kiln.manifest import BuildOptions
    from kiln.optimize.build import build_engine

    gguf_path, hf_dir = make_tiny_gguf(tmp_path, "mixtral")
    build_engine(gguf_path, tmp_path / "engine", BuildOptions(kv_dtype="float32"), progress=lambda _msg: None)
    check_against_transformers(tmp_path / "engine", hf_dir, SHORT_PROMPTS, steps=4, atol=1e-4)
