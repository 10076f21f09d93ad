"""ModelSpec: the architecture facts of a decoder-only model, parsed once from its config.

Every stage reads the model's shape from here (export, optimize, runtime, manifest), so
there is exactly one place that knows how a Hugging Face config maps to kiln's view.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

# Architectures kiln can compile, as Hugging Face names them in config.json "architectures".
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
# The mixture-of-experts families (their MLP is kiln.MoE: kiln/moe.py).
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# The same families as GGUF files name them in general.architecture (export/gguf_architectures.py reads them).
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen2moe", "qwen3moe", "olmoe")
# The families whose blocks are Gemma's: (1 + w) RMSNorms (kiln folds the 1 into the weight when it loads a
# Hugging Face checkpoint; llama.cpp's GGUF converter already stored w + 1), four norms per block, GeGLU.
GEMMA_FAMILIES = ("gemma2", "gemma3")
QWEN_FAMILIES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")  # use_sliding_window gates the window
SLIDING, FULL = "sliding_attention", "full_attention"  # the layer types of config.json "layer_types"


def supported_architectures_sentence() -> str:
    """What kiln compiles, for the error that names an architecture it does not."""
    return (f"kiln supports the Hugging Face architectures {', '.join(SUPPORTED_ARCHITECTURES)} "
            f"and the GGUF architectures {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling, as transformers computes it for each rope_type.

    - linear: every frequency divided by `factor`.
    - llama3: long wavelengths divided by `factor`, short ones kept, the band between
      (low_freq_factor, high_freq_factor of the original context) interpolated.
    - yarn (Qwen2.5 / Qwen3 long-context configs): frequencies blended between kept and divided by `factor`
      over the band of dims that turn between beta_fast and beta_slow times in the original context, and
      cos and sin multiplied by `attention_factor` (0.1 ln(factor) + 1 unless the config gives it).
    - dynamic (NTK): the base stretched for the sequence length at hand, past the original context.
    - longrope (Phi-3): each frequency divided by a per-frequency factor, `short_factor` for contexts up to
      original_max_position_embeddings and `long_factor` beyond; cos and sin multiplied by `attention_factor`.

    Transformers picks dynamic's base and LongRoPE's factor set from the length of the sequence at hand and
    recomputes the whole cache when a sequence grows; a paged KV cache cannot re-rotate the keys it holds, so
    kiln picks them once per engine from its context (`ModelSpec.for_context`: `long_context`,
    `context_length`), as llama.cpp does from n_ctx and vLLM from its max length. An engine then equals
    transformers on every sequence when its context fits the original one; past it, LongRoPE equals it on every
    sequence longer than the original context, and dynamic NTK on a sequence of exactly the engine's context.
    """

    rope_type: str  # "llama3" | "linear" | "yarn" | "dynamic" | "longrope"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()  # longrope only: one divisor per rotary frequency
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0  # longrope and yarn: cos and sin are multiplied by it
    long_context: bool = False  # longrope only: use long_factor (the engine's context exceeds the original)
    beta_fast: float = 32.0  # yarn only: the ramp's bounds, in rotations over the original context
    beta_slow: float = 1.0
    truncate: bool = True  # yarn only: round the ramp's bounds to whole dims (floor / ceil)
    context_length: int = 0  # dynamic only: the sequence length the base is stretched for (0: the original)


@dataclass(frozen=True)
class ModelSpec:
    family: str  # a value of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the MLP's width; each expert's in a mixture-of-experts model
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
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3): q_norm/k_norm weights [head_dim]
    rotary_dim: int = 0  # leading dims of each head that RoPE rotates (Phi-4's partial rotary); 0: all
    # Gemma 2 / 3 (every default is off):
    sandwich_norms: bool = False  # post_attention, pre_feedforward and post_feedforward norms around attention/MLP
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" (SwiGLU) | "gelu_tanh" (GeGLU)
    embedding_scale: float = 1.0  # embeddings are multiplied by it (Gemma: sqrt(hidden), rounded to float32)
    query_pre_attn_scalar: float = 0.0  # attention scale = its power -1/2; 0: head_dim's
    attn_logit_softcap: float = 0.0  # attention scores -> cap * tanh(scores / cap) before the mask; 0: off
    final_logit_softcap: float = 0.0  # logits -> cap * tanh(logits / cap); 0: off
    layer_types: tuple[str, ...] = ()  # per layer SLIDING | FULL; (): every layer slides iff sliding_window
    rope_local_theta: float = 0.0  # RoPE base of the sliding layers, unscaled (Gemma 3); 0: as the others
    qk_norm_span: str = "head"  # "head": q_norm/k_norm over each head (Qwen3); "projection": over all of q / k (OLMoE)
    num_experts: int = 0  # routed experts per layer (kiln.MoE); 0: a dense MLP
    experts_per_token: int = 0  # top_k of the routing
    norm_topk_prob: bool = False  # the chosen experts' probabilities renormalised to sum 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a sigmoid-gated dense expert beside the routed ones

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if not (0 <= self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim {self.rotary_dim} is not an even number of dims within head_dim "
                             f"{self.head_dim}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act {self.hidden_act!r} is neither 'silu' (SwiGLU) nor 'gelu_tanh' (GeGLU)")
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or not set(self.layer_types) <= {SLIDING, FULL}):
            raise ValueError(f"layer_types must name {self.num_layers} layers, each {SLIDING!r} or {FULL!r}; got "
                             f"{list(self.layer_types)}")
        if min(self.attn_logit_softcap, self.final_logit_softcap, self.query_pre_attn_scalar) < 0:
            raise ValueError("soft-caps and query_pre_attn_scalar must be >= 0 (0 = off)")
        if self.qk_norm_span not in ("head", "projection"):
            raise ValueError(f"qk_norm_span must be 'head' or 'projection', got {self.qk_norm_span!r}")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) must be in [1, num_experts="
                             f"{self.num_experts}]")
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "longrope":
            pairs = self.rotated_dims // 2
            for name in ("short_factor", "long_factor"):
                if len(getattr(scaling, name)) != pairs:
                    raise ValueError(f"rope_scaling {name} has {len(getattr(scaling, name))} entries; the "
                                     f"{self.rotated_dims} rotary dims need {pairs}")

    @property
    def rotated_dims(self) -> int:
        """How many leading dims of each head RoPE rotates."""
        return self.rotary_dim or self.head_dim

    def layer_window(self, layer: int) -> int:
        """The sliding window of one layer (0: it attends to the whole context)."""
        if self.layer_types and self.layer_types[layer] == FULL:
            return 0
        return self.sliding_window

    def uses_local_rope(self, layer: int) -> bool:
        """The layer rotates with rope_local_theta, unscaled (Gemma 3's sliding layers)."""
        return bool(self.rope_local_theta) and self.layer_window(layer) > 0

    @property
    def kv_window(self) -> int:
        """The window every layer respects: K/V older than it are read by no layer (0: some layer reads them all)."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        return 0 if 0 in windows else max(windows)

    def for_context(self, max_seq_len: int) -> ModelSpec:
        """This spec as an engine of context max_seq_len computes it: LongRoPE's factor set chosen, dynamic
        NTK's base stretched for max_seq_len."""
        scaling = self.rope_scaling
        if scaling is None or scaling.rope_type not in ("longrope", "dynamic"):
            return self
        if scaling.rope_type == "dynamic":
            chosen = dataclasses.replace(scaling, context_length=max_seq_len)
        else:
            chosen = dataclasses.replace(scaling, long_context=max_seq_len > scaling.original_max_position_embeddings)
        return dataclasses.replace(self, rope_scaling=chosen)

    @property
    def context_length(self) -> int:
        """The longest context the model is made for: max_position_embeddings, or the length its rope scaling
        stretches the original context to when that is longer (vLLM's rule: yarn's original context times
        its factor; linear and dynamic: max_position_embeddings times the factor; llama3 and LongRoPE
        configs already give the scaled length)."""
        scaling = self.rope_scaling
        if scaling is None or scaling.rope_type in ("llama3", "longrope"):
            return self.max_position_embeddings
        base = scaling.original_max_position_embeddings if scaling.rope_type == "yarn" else self.max_position_embeddings
        return max(self.max_position_embeddings, int(base * scaling.factor))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

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
        if family is None and config.get("model_type") in SUPPORTED_ARCHITECTURES.values():
            family = config["model_type"]
        if family is None:
            named = ", ".join(archs) if archs else f"model_type {config.get('model_type')!r}"
            raise ValueError(f"unsupported architecture {named}: {supported_architectures_sentence()}")
        _check_supported_features(config, family)
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        scaling = config.get("rope_scaling") or None
        rope_theta = config.get("rope_theta")
        # transformers >= 5 nests rope settings under "rope_parameters" (Gemma 3: one set per layer type).
        params = config.get("rope_parameters") or {}
        if FULL in params:
            params = params[FULL] or {}
        if rope_theta is None:
            rope_theta = params.get("rope_theta", 1e6 if family == "gemma3" else 10000.0)
        if scaling is None and params.get("rope_type", "default") != "default":
            scaling = params
        head_dim = config.get("head_dim") or hidden // num_heads
        partial = config.get("partial_rotary_factor", params.get("partial_rotary_factor")) or 1.0
        if partial != 1.0 and family != "phi3":  # only Phi-3's modelling code rotates part of the head
            raise ValueError(f"unsupported partial_rotary_factor {partial} for {family}: kiln rotates part of the "
                             "head for phi3 only")
        rotary_dim = int(head_dim * partial) if partial != 1.0 else 0
        return cls(
            family=family,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config.get("moe_intermediate_size") or config["intermediate_size"]
            if family in MOE_FAMILIES else config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", family in GEMMA_FAMILIES)),
            attention_bias=bool(config.get("attention_bias", config.get("qkv_bias", family in ("qwen2", "qwen2_moe")))),
            rope_scaling=parse_rope_scaling(scaling, config),
            **_window_fields(config, family),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=family in ("qwen3", "gemma3", "qwen3_moe", "olmoe"),
            rotary_dim=rotary_dim,
            **(_gemma_fields(config, family) if family in GEMMA_FAMILIES else {}),
            **_moe_fields(config, family),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        data = dict(data)
        if data.get("rope_scaling"):
            scaling = dict(data["rope_scaling"])
            for name in ("short_factor", "long_factor"):
                scaling[name] = tuple(scaling.get(name, ()))
            data["rope_scaling"] = RopeScaling(**scaling)
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        data["layer_types"] = tuple(data.get("layer_types", ()))
        return cls(**data)


def parse_rope_scaling(scaling: dict[str, Any] | None, config: dict[str, Any]) -> RopeScaling | None:
    if not scaling:
        return None
    rope_type = scaling.get("rope_type") or scaling.get("type")
    if rope_type in (None, "default"):
        return None
    if rope_type == "longrope":
        return _parse_longrope(scaling, config)
    if rope_type == "yarn":
        return _parse_yarn(scaling, config)
    if rope_type not in ("llama3", "linear", "dynamic"):
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}: kiln supports 'linear', 'dynamic', "
                         "'llama3', 'yarn' and 'longrope'")
    # dynamic NTK stretches the base past max_position_embeddings: that is its original context
    default_original = config.get("max_position_embeddings", 2048) if rope_type == "dynamic" else 8192
    return RopeScaling(
        rope_type=rope_type,
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            default_original if rope_type == "dynamic" else scaling.get("original_max_position_embeddings", 8192)),
    )


def _parse_yarn(scaling: dict[str, Any], config: dict[str, Any]) -> RopeScaling:
    """YaRN with transformers' defaults: the original context from the config's top-level
    original_max_position_embeddings (transformers gives it priority), else rope_scaling's, else
    max_position_embeddings; the factor max / original unless given;
    the attention factor 0.1 ln(factor) + 1 (or mscale / mscale_all_dim's ratio) unless given."""
    original = int(config.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
                   or config.get("max_position_embeddings", 2048))
    factor = scaling.get("factor") or config.get("max_position_embeddings", original) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                     else _yarn_mscale(factor, 1.0))
    return RopeScaling(
        rope_type="yarn",
        factor=float(factor),
        original_max_position_embeddings=original,
        attention_factor=float(attention),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        truncate=bool(scaling.get("truncate", True)),
    )


def _yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction, 0.1 * mscale * ln(factor) + 1 (1 when the factor does not stretch)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _parse_longrope(scaling: dict[str, Any], config: dict[str, Any]) -> RopeScaling:
    """Phi-3's LongRoPE, with transformers' defaults: the factor is max / original context, and the
    attention factor sqrt(1 + ln(factor) / ln(original)) unless given."""
    original = scaling.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    if not original:
        raise ValueError("longrope rope_scaling needs original_max_position_embeddings")
    original = int(original)
    factor = scaling.get("factor") or config.get("max_position_embeddings", original) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        rope_type="longrope",
        factor=float(factor),
        original_max_position_embeddings=original,
        short_factor=tuple(float(f) for f in scaling["short_factor"]),
        long_factor=tuple(float(f) for f in scaling["long_factor"]),
        attention_factor=float(attention),
    )


def _moe_fields(config: dict[str, Any], family: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a family's config (none for a dense family); configs whose layers are
    not all sparse, or that clip q/k/v (OLMoE's clip_qkv), fail with one sentence."""
    if family not in MOE_FAMILIES:
        return {}
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"unsupported {family} config: dense MLP layers among the sparse ones (mlp_only_layers / "
                         "decoder_sparse_step); kiln compiles models whose every layer is sparse")
    if config.get("clip_qkv") is not None:
        raise ValueError(f"unsupported {family} config: clip_qkv={config['clip_qkv']}")
    # Mixtral names it num_local_experts, the others num_experts (Qwen3-MoE's transformers >= 5 configs: either)
    experts = config.get("num_local_experts") or config.get("num_experts")
    if not experts:
        raise ValueError(f"{family} config names no experts (num_local_experts / num_experts)")
    return {
        "num_experts": int(experts),
        "experts_per_token": int(config["num_experts_per_tok"]),
        "norm_topk_prob": True if family == "mixtral" else bool(config.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": int(config.get("shared_expert_intermediate_size") or 0)
        if family == "qwen2_moe" else 0,
        "qk_norm_span": "projection" if family == "olmoe" else "head",
    }


def _check_supported_features(config: dict[str, Any], family: str) -> None:
    """Reject config features the reference model does not implement, with one sentence each."""
    if family in GEMMA_FAMILIES:
        act = _gemma_activation(config)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_activation {act!r} for {family}: kiln supports GeGLU with "
                             "gelu_pytorch_tanh")
        if config.get("use_bidirectional_attention"):
            raise ValueError(f"unsupported use_bidirectional_attention=true for {family}: kiln compiles causal "
                             "decoders")
    else:
        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}: kiln supports SwiGLU MLPs (silu)")
    if config.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=true: kiln supports bias-free MLPs")


def _gemma_activation(config: dict[str, Any]) -> str:
    # transformers' Gemma classes read hidden_activation; older configs carry hidden_act as well
    return str(config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh")


def _gemma_fields(config: dict[str, Any], family: str) -> dict[str, Any]:
    """The Gemma 2 / 3 pieces of a config, as transformers' Gemma2/Gemma3 classes read them: every other layer
    sliding (Gemma 2) or five of six (Gemma 3, sliding_window_pattern), the attention logit soft-cap on Gemma 2
    only (Gemma 3's attention ignores attn_logit_softcapping), the embedding scaled by sqrt(hidden) in float32."""
    layers = config["num_hidden_layers"]
    pattern = 2 if family == "gemma2" else int(config.get("sliding_window_pattern") or 6)
    types = config.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    local = 0.0
    if family == "gemma3":
        params = config.get("rope_parameters") or {}
        local_params = params.get(SLIDING) or {}
        if local_params.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope_type {local_params['rope_type']!r} on gemma3's sliding layers: kiln "
                             "rotates them with the plain local base")
        local = float(local_params.get("rope_theta") or config.get("rope_local_base_freq") or 10000.0)
    softcap = config.get("attn_logit_softcapping") if family == "gemma2" else None
    return dict(
        sandwich_norms=True,
        hidden_act="gelu_tanh",
        embedding_scale=float(np.float32(config["hidden_size"] ** 0.5)),
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or 256),
        attn_logit_softcap=float(softcap or 0.0),
        final_logit_softcap=float(config.get("final_logit_softcapping") or 0.0),
        layer_types=tuple(types),
        rope_local_theta=local,
    )


def _window_fields(config: dict[str, Any], family: str) -> dict[str, Any]:
    """sliding_window, and for Qwen families the per-layer layer_types, as transformers' classes read them.
    Qwen2/Qwen3: use_sliding_window turns the window on for the layers config.json's layer_types names sliding
    (without it: layers max_window_layers, ... on). Qwen2-MoE: its default layer_types are the even layers below
    max_window_layers. Qwen3-MoE: every layer. Other families: the window, if any, on every layer (Gemma's
    layer_types come from _gemma_fields)."""
    window = int(config.get("sliding_window") or 0)
    if family not in QWEN_FAMILIES:
        return {"sliding_window": window}
    if not (config.get("use_sliding_window", False) and window):
        return {"sliding_window": 0}
    if family == "qwen3_moe":
        return {"sliding_window": window}
    max_window_layers = config.get("max_window_layers", 28)  # transformers' default
    layers = range(config["num_hidden_layers"])
    if family == "qwen2_moe":
        default = [SLIDING if i % 2 == 0 and i < max_window_layers else FULL for i in layers]
    else:
        default = [SLIDING if i >= max_window_layers else FULL for i in layers]
    layer_types = tuple(config.get("layer_types") or default)
    if SLIDING not in layer_types:
        return {"sliding_window": 0}
    if FULL not in layer_types:
        return {"sliding_window": window}
    return {"sliding_window": window, "layer_types": layer_types}
