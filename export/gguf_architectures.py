"""The GGUF architectures kiln reads, and how llama.cpp's converter wrote each of them.

Per architecture (general.architecture): the metadata key prefix (``qwen3.block_count``...), the map from
GGUF tensor names to Hugging Face names, and what the converter did to the weights that kiln undoes:

- ``llama``: attn_q / attn_k rows permuted to interleaved rotary pairs (undone here); Llama 3 rope scaling
  baked into a ``rope_freqs`` tensor of per-frequency divisors (recovered as llama3 parameters).
- ``qwen2`` / ``qwen3``: stored as Hugging Face has them (NEOX rotary, no permutation); qwen2 carries
  q/k/v biases, qwen3 per-head ``attn_q_norm`` / ``attn_k_norm``.
- ``phi3``: fused ``attn_qkv`` and ``ffn_up`` (gate and up rows, in that order), split like the HF
  checkpoint's qkv_proj / gate_up_proj; LongRoPE as ``rope_factors_short`` / ``rope_factors_long`` tensors,
  ``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor``; partial rotary as
  ``rope.dimension_count`` below the head dim.
- ``gemma2`` / ``gemma3``: norm weights stored with Gemma's 1 already added (read as they are: kiln's Hugging Face
  loader adds the same 1); the four block norms as ``attn_norm``, ``post_attention_norm``, ``ffn_norm`` (the
  pre-feedforward one) and ``post_ffw_norm``; soft-caps as ``attn_logit_softcapping`` /
  ``final_logit_softcapping``; ``attention.sliding_window`` with the layer pattern llama.cpp fixes per
  architecture (every other layer from layer 0 for gemma2, five of six for gemma3: read from
  ``attention.sliding_window_pattern`` when a file has it) and gemma3's local RoPE base 10000 (or
  ``rope.freq_base_swa``). The attention scale is not stored: llama.cpp derives it from the model size
  (1/sqrt(hidden / heads) for the 27B models, 1/sqrt(head_dim) otherwise) and so does kiln.
- mixture of experts (``llama`` with ``expert_count`` is Mixtral; ``qwen2moe``, ``qwen3moe``, ``olmoe``): the router
  ``ffn_gate_inp``, the experts' projections stacked ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``
  [E, rows, cols], Qwen2-MoE's shared expert ``ffn_*_shexp`` and its gate ``ffn_gate_inp_shexp``; whether the chosen
  experts' weights are renormalised is fixed per architecture in llama.cpp (Mixtral and Qwen3-MoE yes, Qwen2-MoE
  and OLMoE no) unless ``expert_weights_norm`` says otherwise.

The result is the same Checkpoint the Hugging Face directory of that model loads to.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kiln.spec import (
    FULL,
    GEMMA_FAMILIES,
    SLIDING,
    SUPPORTED_GGUF_ARCHITECTURES,
    ModelSpec,
    RopeScaling,
    parse_rope_scaling,
    supported_architectures_sentence,
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LLAMA_BLOCKS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QWEN3_BLOCKS = {**_LLAMA_BLOCKS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Mixture-of-experts blocks: the router, each projection stacked over the experts [E, rows, cols] (joined into
# kiln.MoE's gate_up by export/moe_weights.py), and Qwen2-MoE's shared expert with its sigmoid gate.
_MOE_BLOCKS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Routing that llama.cpp fixes per architecture (build_moe_ffn's norm_w) unless expert_weights_norm says otherwise.
_RENORMALISES = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False}
_PHI3_BLOCKS = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA_BLOCKS = {
    **_QWEN3_BLOCKS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors that describe the rotary embedding rather than weights: read into the spec, never renamed.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")


@dataclass(frozen=True)
class GgufArchitecture:
    name: str  # general.architecture, also the metadata key prefix
    family: str  # kiln's family (ModelSpec.family)
    block_names: Mapping[str, str]  # blk.N.<part> -> model.layers.N.<module>
    permutes_rotary_rows: bool = False  # llama.cpp permuted attn_q / attn_k rows (llama only)

    def spec(self, md: dict, shapes: dict[str, tuple[int, ...]], rope: dict[str, torch.Tensor],
             path: Path) -> ModelSpec:
        """The ModelSpec from the metadata, the tensor shapes and the rope tensors (ROPE_TENSORS present)."""
        spec = _spec_from_metadata(self, md, shapes, rope, path)
        if self.family in GEMMA_FAMILIES:
            try:
                spec = dataclasses.replace(spec, **_gemma_fields(self.name, md, spec))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}: bad GGUF metadata ({_first_line(exc)})") from None
        freqs = rope.get("rope_freqs.weight")
        return _with_llama3_scaling(spec, freqs, path) if freqs is not None else spec

    def rotary_heads(self, name: str, spec: ModelSpec) -> int:
        """The heads whose rows llama.cpp permuted in this GGUF tensor (attn_q / attn_k of llama), else 0."""
        match = _BLOCK_RE.match(name)
        if not self.permutes_rotary_rows or match is None:
            return 0
        return {"attn_q": spec.num_heads, "attn_k": spec.num_kv_heads}.get(match.group(2), 0)

    def hf_name(self, name: str, path: Path) -> str:
        """The Hugging Face name of a GGUF tensor (fused ones split later: export/fused_weights.py)."""
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        match = _BLOCK_RE.match(name)
        if match and match.group(2) in self.block_names:
            layer, part, kind = match.groups()
            return f"model.layers.{layer}.{self.block_names[part]}.{kind}"
        raise ValueError(f"{path}: unexpected GGUF tensor {name!r} for a {self.name} model")


GGUF_ARCHITECTURES = {
    "llama": GgufArchitecture("llama", "llama", _LLAMA_BLOCKS, permutes_rotary_rows=True),
    "qwen2": GgufArchitecture("qwen2", "qwen2", _LLAMA_BLOCKS),
    "qwen3": GgufArchitecture("qwen3", "qwen3", _QWEN3_BLOCKS),
    "phi3": GgufArchitecture("phi3", "phi3", _PHI3_BLOCKS),
    "gemma2": GgufArchitecture("gemma2", "gemma2", _GEMMA_BLOCKS),
    "gemma3": GgufArchitecture("gemma3", "gemma3", _GEMMA_BLOCKS),
    "qwen2moe": GgufArchitecture("qwen2moe", "qwen2_moe", {**_LLAMA_BLOCKS, **_MOE_BLOCKS}),
    "qwen3moe": GgufArchitecture("qwen3moe", "qwen3_moe", {**_QWEN3_BLOCKS, **_MOE_BLOCKS}),
    "olmoe": GgufArchitecture("olmoe", "olmoe", {**_QWEN3_BLOCKS, **_MOE_BLOCKS}),
}
GGUF_ARCHITECTURES["llama"] = dataclasses.replace(GGUF_ARCHITECTURES["llama"],
                                                  block_names={**_LLAMA_BLOCKS, **_MOE_BLOCKS})
# block_count of the 27B models, whose attention scale llama.cpp takes from hidden / heads (not head_dim)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
assert tuple(GGUF_ARCHITECTURES) == SUPPORTED_GGUF_ARCHITECTURES


def gguf_architecture(name: object, path: Path) -> GgufArchitecture:
    """The architecture a file's general.architecture names, or one sentence naming what kiln reads."""
    if not isinstance(name, str) or name not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {name!r}; {supported_architectures_sentence()}")
    return GGUF_ARCHITECTURES[name]


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def nice_float(value: float) -> float:
    """GGUF stores float32; 9.999999747e-06 -> 1e-05."""
    return float(str(np.float32(value)))


def _spec_from_metadata(
    arch: GgufArchitecture, md: dict, shapes: dict[str, tuple[int, ...]], rope: dict[str, torch.Tensor], path: Path
) -> ModelSpec:
    prefix = arch.name

    def get(key, default=None):
        value = md.get(f"{prefix}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {prefix}.{key}")
        return value

    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(md.get(f"{prefix}.attention.key_length") or hidden // num_heads)
    rope_dim = int(md.get(f"{prefix}.rope.dimension_count") or head_dim)
    if rope_dim != head_dim and arch.name != "phi3":
        raise ValueError(
            f"{path}: partial rotary embeddings (rope dim {rope_dim} of head dim {head_dim}) are not supported "
            f"for {arch.name}"
        )
    if "token_embd.weight" not in shapes:
        raise ValueError(f"{path}: GGUF has no token_embd.weight tensor")
    vocab = md.get(f"{prefix}.vocab_size") or shapes["token_embd.weight"][0]
    bos = md.get("tokenizer.ggml.bos_token_id")
    eos_ids = tuple(
        dict.fromkeys(int(md[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in md)
    )
    context = int(md.get(f"{prefix}.context_length", 2048))
    moe = _moe_fields(arch, md, shapes)
    rotary = _longrope(md, rope, context, path) if arch.name == "phi3" else _rope_scaling(md, prefix, path)
    try:
        return ModelSpec(
            family="mixtral" if arch.name == "llama" and moe else arch.family,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(md.get(f"{prefix}.expert_feed_forward_length") or get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(md.get(f"{prefix}.attention.head_count_kv") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=nice_float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=nice_float(md.get(f"{prefix}.rope.freq_base", 10000.0)),
            max_position_embeddings=context,
            tie_word_embeddings="output.weight" not in shapes,
            attention_bias="blk.0.attn_q.bias" in shapes,
            rope_scaling=rotary,
            sliding_window=int(md.get(f"{prefix}.attention.sliding_window") or 0),
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos_ids,
            qk_norm="blk.0.attn_q_norm.weight" in shapes,
            rotary_dim=rope_dim if rope_dim != head_dim else 0,
            **moe,
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: bad GGUF metadata ({_first_line(exc)})") from None


def _gemma_fields(prefix: str, md: dict, spec: ModelSpec) -> dict:
    """The Gemma pieces llama.cpp reads for gemma2 / gemma3 (see the module doc)."""
    layers = spec.num_layers
    pattern = md.get(f"{prefix}.attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == layers:  # a per-layer flag: the layer slides
        types = tuple(SLIDING if flag else FULL for flag in pattern)
    else:
        every = 2 if prefix == "gemma2" else int(pattern or 6)
        types = tuple(SLIDING if (i + 1) % every else FULL for i in range(layers))
    scalar = spec.hidden_size // spec.num_heads if layers == _GEMMA_27B_LAYERS[prefix] else spec.head_dim
    local = nice_float(md.get(f"{prefix}.rope.freq_base_swa", 10000.0)) if prefix == "gemma3" else 0.0
    return dict(
        sandwich_norms=True,
        hidden_act="gelu_tanh",
        embedding_scale=float(np.float32(spec.hidden_size ** 0.5)),
        query_pre_attn_scalar=float(scalar),
        attn_logit_softcap=nice_float(md.get(f"{prefix}.attn_logit_softcapping") or 0.0) if prefix == "gemma2" else 0.0,
        final_logit_softcap=nice_float(md.get(f"{prefix}.final_logit_softcapping") or 0.0),
        layer_types=types,
        rope_local_theta=local,
    )


def _moe_fields(arch: GgufArchitecture, md: dict, shapes: dict[str, tuple[int, ...]]) -> dict:
    """ModelSpec's mixture-of-experts fields from {arch}.expert_* metadata (none for a dense model)."""
    prefix = arch.name
    experts = int(md.get(f"{prefix}.expert_count") or 0)
    if not experts:
        return {}
    norm = md.get(f"{prefix}.expert_weights_norm")
    return {
        "num_experts": experts,
        "experts_per_token": int(md.get(f"{prefix}.expert_used_count") or 0),
        "norm_topk_prob": bool(norm) if norm is not None else _RENORMALISES.get(prefix, False),
        "shared_expert_intermediate_size": int(md.get(f"{prefix}.expert_shared_feed_forward_length") or 0)
        if "blk.0.ffn_gate_shexp.weight" in shapes else 0,
        "qk_norm_span": "projection" if prefix == "olmoe" else "head",
    }


def _rope_scaling(md: dict, prefix: str, path: Path) -> RopeScaling | None:
    """linear or YaRN scaling from the rope.scaling keys llama.cpp's converter writes (llama3's is a tensor)."""
    kind = md.get(f"{prefix}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"{path}: unsupported GGUF rope scaling {kind!r} (kiln supports linear, yarn and llama3)")
    factor = md.get(f"{prefix}.rope.scaling.factor")
    if not factor or factor == 1.0:
        return None
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=nice_float(factor))
    original = md.get(f"{prefix}.rope.scaling.original_context_length")
    if not original:
        raise ValueError(f"{path}: GGUF yarn rope scaling without {prefix}.rope.scaling.original_context_length")
    # llama.cpp multiplies its attn_factor onto YaRN's own 0.1 ln(factor) + 1
    extra = float(md.get(f"{prefix}.rope.scaling.attn_factor") or 1.0)
    yarn = parse_rope_scaling({"rope_type": "yarn", "factor": nice_float(factor)},
                              {"original_max_position_embeddings": int(original)})
    assert yarn is not None
    return dataclasses.replace(yarn, attention_factor=yarn.attention_factor * extra)


def _longrope(md: dict, rope: dict[str, torch.Tensor], context: int, path: Path) -> RopeScaling | None:
    """Phi-3's LongRoPE from the factor tensors llama.cpp writes (none: plain RoPE, as Phi-3-mini-4k)."""
    short, long = rope.get("rope_factors_short.weight"), rope.get("rope_factors_long.weight")
    if short is None and long is None:
        return None
    if short is None or long is None:
        raise ValueError(f"{path}: GGUF has one of rope_factors_short / rope_factors_long but not the other")
    original = md.get("phi3.rope.scaling.original_context_length")
    if not original:
        raise ValueError(f"{path}: GGUF LongRoPE factors without phi3.rope.scaling.original_context_length")
    return RopeScaling(
        rope_type="longrope",
        factor=context / int(original),
        original_max_position_embeddings=int(original),
        short_factor=tuple(nice_float(f) for f in short.reshape(-1).tolist()),
        long_factor=tuple(nice_float(f) for f in long.reshape(-1).tolist()),
        attention_factor=float(md.get("phi3.rope.scaling.attn_factor", 1.0)),
    )


def _with_llama3_scaling(spec: ModelSpec, freqs: torch.Tensor, path: Path) -> ModelSpec:
    """llama.cpp bakes Llama 3 rope scaling into a rope_freqs tensor (per-frequency divisors);
    recover the llama3 parameters that reproduce it."""
    from .reference import rope_inv_freq

    freqs = freqs.reshape(-1).to(torch.float64)
    base = rope_inv_freq(dataclasses.replace(spec, rope_scaling=None)).to(torch.float64)
    if freqs.shape != base.shape:
        raise ValueError(f"{path}: rope_freqs has {freqs.numel()} entries, expected {base.numel()}")
    if torch.allclose(freqs, torch.ones_like(freqs)):
        return spec
    factor = float(freqs.max())
    # Any parameters that reproduce the divisors give the same inv_freq, hence the same model.
    for original in [spec.max_position_embeddings] + [2**k for k in range(4, 21)]:
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            scaling = RopeScaling("llama3", factor, low, high, original)
            scaled = rope_inv_freq(dataclasses.replace(spec, rope_scaling=scaling)).to(torch.float64)
            if torch.allclose(base / scaled, freqs, rtol=1e-3):
                return dataclasses.replace(spec, rope_scaling=scaling)
    raise ValueError(f"{path}: rope_freqs does not match any llama3 rope scaling kiln can express")
