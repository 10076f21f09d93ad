"""kiln.MoE's numpy spec (kiln/moe.py) and the exporter's torch op (export/moe.py) against transformers' own sparse MoE
blocks of each family, and per-expert checkpoints stacked into the op's weights (export/moe_weights.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_hf_config

from kiln.export.moe import moe as moe_torch
from kiln.export.moe_weights import stack_experts
from kiln.moe import moe_ref
from kiln.spec import ModelSpec

BLOCKS = {
    "mixtral": ("mixtral", "MixtralSparseMoeBlock"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    "olmoe": ("olmoe", "OlmoeSparseMoeBlock"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeSparseMoeBlock"),
}


def hf_block(family: str):
    import importlib

    module, name = BLOCKS[family]
    config = tiny_hf_config(family)
    block = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    return config, block


@pytest.mark.parametrize("family", list(BLOCKS))
def test_spec_equals_the_transformers_block(family):
    config, block = hf_block(family)
    spec = ModelSpec.from_hf_config(config.to_dict() | {"architectures": config.architectures})
    x = torch.randn(1, 13, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(x)
        if spec.shared_expert_intermediate_size:  # the shared expert sits beside the op, in graph ops
            want = want - torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    weights = [block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj]
    args = [w.detach().numpy() for w in weights]
    got = moe_ref(x.numpy(), *args, top_k=spec.experts_per_token, norm_topk_prob=spec.norm_topk_prob)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        eager = moe_torch(x, *weights, spec.experts_per_token, spec.norm_topk_prob)
    np.testing.assert_allclose(eager.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)
    # the routing flag is the family's: the other setting gives another output
    other = moe_ref(x.numpy(), *args, top_k=spec.experts_per_token, norm_topk_prob=not spec.norm_topk_prob)
    assert np.abs(other - want.numpy()).max() > 1e-3


def test_family_routing_flags():
    flags = {family: ModelSpec.from_hf_config(tiny_hf_config(family).to_dict()
                                              | {"architectures": tiny_hf_config(family).architectures})
             for family in BLOCKS}
    assert flags["mixtral"].norm_topk_prob and flags["qwen3_moe"].norm_topk_prob
    assert not flags["olmoe"].norm_topk_prob and not flags["qwen2_moe"].norm_topk_prob
    assert flags["olmoe"].qk_norm_span == "projection" and flags["qwen3_moe"].qk_norm_span == "head"
    assert flags["qwen2_moe"].shared_expert_intermediate_size == 128 and flags["qwen2_moe"].attention_bias


def test_per_expert_weights_stack_in_expert_order_gate_rows_first():
    spec = ModelSpec.from_hf_config(tiny_hf_config("mixtral", num_hidden_layers=1).to_dict()
                                    | {"architectures": ["MixtralForCausalLM"]})
    e, d, f = spec.num_experts, spec.hidden_size, spec.intermediate_size
    weights = {"model.layers.0.block_sparse_moe.gate.weight": torch.zeros(e, d)}
    for j in range(e):
        for proj, rows, cols in (("w1", f, d), ("w3", f, d), ("w2", d, f)):
            value = {"w1": 1.0, "w3": 2.0, "w2": 3.0}[proj] + 10 * j
            weights[f"model.layers.0.block_sparse_moe.experts.{j}.{proj}.weight"] = torch.full((rows, cols), value)
    stacked = stack_experts(spec, weights, "test")
    gate_up, down = stacked["model.layers.0.mlp.experts.gate_up_proj"], stacked["model.layers.0.mlp.experts.down_proj"]
    assert gate_up.shape == (e, 2 * f, d) and down.shape == (e, d, f)
    assert gate_up[5, 0, 0] == 51 and gate_up[5, f, 0] == 52 and down[5, 0, 0] == 53
    assert "model.layers.0.mlp.gate.weight" in stacked
    del weights["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    with pytest.raises(ValueError, match="expert 3 lacks down_proj"):
        stack_experts(spec, weights, "test")
