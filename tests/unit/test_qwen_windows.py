"""Which layers of a Qwen-family config slide: kiln's ModelSpec against the windows transformers' own attention
modules take from the same config (Qwen2/Qwen3: layers max_window_layers, ... on, or config.json's layer_types;
Qwen2-MoE: even layers below max_window_layers; Qwen3-MoE: every layer), with and without use_sliding_window."""

from __future__ import annotations

import pytest
from helpers import tiny_hf_config

from kiln.spec import FULL, SLIDING, ModelSpec

CASES = {
    "off": dict(use_sliding_window=False, sliding_window=8, max_window_layers=2),
    "upper-half": dict(use_sliding_window=True, sliding_window=8, max_window_layers=2),
    "every-layer": dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),
    "no-layer": dict(use_sliding_window=True, sliding_window=8, max_window_layers=4),
    "explicit-types": dict(use_sliding_window=True, sliding_window=8,
                           layer_types=[SLIDING, FULL, SLIDING, FULL]),
}


def transformers_windows(config) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(config)
    return [getattr(layer.self_attn, "sliding_window", None) or 0 for layer in model.model.layers]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("saved_layer_types", [True, False], ids=["layer-types-saved", "from-max-window-layers"])
def test_layer_windows_match_transformers(family, case, saved_layer_types):
    if case == "explicit-types" and (family == "qwen3_moe" or not saved_layer_types):
        pytest.skip("qwen3_moe has no layer_types; explicit types exist only as saved")
    config = tiny_hf_config(family, num_hidden_layers=4, **CASES[case])
    data = config.to_dict() | {"architectures": config.architectures}
    if not saved_layer_types:
        data.pop("layer_types", None)
    spec = ModelSpec.from_hf_config(data)
    expected = transformers_windows(config)
    assert [spec.layer_window(i) for i in range(spec.num_layers)] == expected
    # K/V leave the window only when every layer respects it
    assert spec.kv_window == (0 if 0 in expected else 8)
    assert ModelSpec.from_dict(spec.to_dict()) == spec


def test_default_max_window_layers_is_transformers():
    """A config that leaves max_window_layers out gets transformers' default (28): 30 layers, the last 2 slide."""
    config = tiny_hf_config("qwen2", num_hidden_layers=30, use_sliding_window=True, sliding_window=8)
    data = config.to_dict() | {"architectures": config.architectures}
    data.pop("layer_types"), data.pop("max_window_layers")
    spec = ModelSpec.from_hf_config(data)
    assert [spec.layer_window(i) for i in range(30)] == transformers_windows(config) == [0] * 28 + [8, 8]
