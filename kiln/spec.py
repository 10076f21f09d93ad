"""ModelSpec: the architecture facts of a decoder-only model, parsed once from its config.

Every stage reads the model's shape from here (export, optimize, runtime, manifest), so
there is exactly one place that knows how a Hugging Face config maps to kiln's view.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# Architectures kiln can compile, as Hugging Face names them in config.json "architectures".
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling (Llama 3 style, or linear)."""

    rope_type: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    family: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    rope_scaling: RopeScaling | None = None
    sliding_window: int = 0  # 0: full causal attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelSpec:
        """Parse a Hugging Face config.json dict; unsupported models fail with one sentence."""
        archs = config.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            model_type = config.get("model_type", "")
            family = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}.get(model_type)
        if family is None:
            raise ValueError(
                f"unsupported architecture {archs or config.get('model_type')!r}: kiln supports "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        _check_supported_features(config)
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        scaling = config.get("rope_scaling") or None
        rope_theta = config.get("rope_theta")
        # transformers >= 5 nests rope settings under "rope_parameters".
        params = config.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = params.get("rope_theta", 10000.0)
        if scaling is None and params.get("rope_type", "default") != "default":
            scaling = params
        return cls(
            family=family,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden // num_heads,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", family == "qwen2")),
            rope_scaling=_parse_rope_scaling(scaling),
            sliding_window=_sliding_window(config, family),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        data = dict(data)
        if data.get("rope_scaling"):
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        return cls(**data)


def _parse_rope_scaling(scaling: dict[str, Any] | None) -> RopeScaling | None:
    if not scaling:
        return None
    rope_type = scaling.get("rope_type") or scaling.get("type")
    if rope_type in (None, "default"):
        return None
    if rope_type not in ("llama3", "linear"):
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}: kiln supports 'llama3' and 'linear'")
    return RopeScaling(
        rope_type=rope_type,
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def _check_supported_features(config: dict[str, Any]) -> None:
    """Reject config features the reference model does not implement, with one sentence each."""
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r}: kiln supports SwiGLU MLPs (silu)")
    if config.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=true: kiln supports bias-free MLPs")
    params = config.get("rope_parameters") or {}
    partial = config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"unsupported partial_rotary_factor {partial}: kiln rotates the full head")


def _sliding_window(config: dict[str, Any], family: str) -> int:
    window = config.get("sliding_window")
    if family == "qwen2":
        if not config.get("use_sliding_window", False):
            return 0
        # Qwen2 slides only from layer max_window_layers on; kiln has one window for all layers.
        layer_types = config.get("layer_types") or [
            "sliding_attention" if i >= config.get("max_window_layers", 0) else "full_attention"
            for i in range(config["num_hidden_layers"])
        ]
        if len(set(layer_types)) > 1:
            raise ValueError("unsupported Qwen2 config: sliding window on some layers only")
        if set(layer_types) == {"full_attention"}:
            return 0
    return int(window) if window else 0
