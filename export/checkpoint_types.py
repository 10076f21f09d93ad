"""The Checkpoint every model source loads into, and the weight-set check both loaders share.

Its own module so that the loaders (checkpoint.py for HF dirs and the dispatch, gguf_loader.py)
import it and never each other in both directions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch

from kiln.spec import ModelSpec


class TensorSource(Protocol):
    """A tensor in a file, read on demand (export/tensor_files.py)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def read(self) -> torch.Tensor: ...


class LazyWeights(Mapping[str, torch.Tensor]):
    """Weights read from their files when asked for, as float32, and never cached: a build asks for each
    tensor about once and drops it, so the model's fp32 weights never exist in memory together.
    dict(weights) (what calibration does) reads them all."""

    def __init__(self, sources: Mapping[str, TensorSource]) -> None:
        self._sources = dict(sources)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._sources[name].read().to(torch.float32).contiguous()

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor
        return name in self._sources

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._sources[name].shape)

    def file_blocks(self, name: str) -> object | None:
        """The weight's rows as its file's quantized blocks (a GGUF matrix: tensor_files.FileBlocks), or None. Read
        through the source's own method, so this module needs no import of tensor_files (which imports it)."""
        method = getattr(self._sources[name], "file_blocks", None)
        return method() if callable(method) else None

    def sources(self) -> dict[str, TensorSource]:
        """Where each weight is read from (for views that read parts of a tensor, e.g. fused projections)."""
        return dict(self._sources)

    def subset(self, names: list[str]) -> LazyWeights:
        return LazyWeights({name: self._sources[name] for name in names})


def weight_shape(weights: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """A weight's shape without reading it when the weights are lazy."""
    if isinstance(weights, LazyWeights):
        return weights.shape(name)
    return tuple(weights[name].shape)


@dataclass(frozen=True)
class TokenizerFiles:
    tokenizer_json: str  # a serialized `tokenizers` tokenizer (tokenizer.json content)
    tokenizer_config: dict  # chat_template, bos_token, eos_token, add_bos_token, ...


@dataclass(frozen=True, eq=False)
class Checkpoint:
    spec: ModelSpec
    weights: Mapping[str, torch.Tensor] = field(repr=False)  # float32, HF parameter names; LazyWeights from files
    tokenizer: TokenizerFiles | None = field(repr=False)
    source: str

    def fingerprint(self) -> str:
        """sha256 over the spec and every weight (name, dtype, shape, bytes), in name order."""
        return self._fingerprint

    @cached_property
    def _fingerprint(self) -> str:
        digest = hashlib.sha256()
        digest.update(json.dumps(self.spec.to_dict(), sort_keys=True).encode())
        for name in sorted(self.weights):
            tensor = self.weights[name].detach().contiguous().cpu()
            digest.update(f"\n{name}:{tensor.dtype}:{tuple(tensor.shape)}\n".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        return digest.hexdigest()


def lm_head_weight_name(spec: ModelSpec) -> str:
    """The weight the LM head reads: the embedding table when tied."""
    return "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"


def expected_weight_names(spec: ModelSpec) -> list[str]:
    """The HF parameter names a checkpoint of this spec must provide."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if spec.sandwich_norms:
            names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
        names += [p + f"self_attn.{n}_proj.weight" for n in ("q", "k", "v", "o")]
        if spec.attention_bias:
            names += [p + f"self_attn.{n}_proj.bias" for n in ("q", "k", "v")]
        if spec.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += _mlp_weight_names(spec, p)
    return names


def _mlp_weight_names(spec: ModelSpec, prefix: str) -> list[str]:
    if not spec.is_moe:
        return [prefix + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    names = [prefix + "mlp.gate.weight", prefix + "mlp.experts.gate_up_proj", prefix + "mlp.experts.down_proj"]
    if spec.shared_expert_intermediate_size:
        names += [prefix + f"mlp.shared_expert.{n}_proj.weight" for n in ("gate", "up", "down")]
        names.append(prefix + "mlp.shared_expert_gate.weight")
    return names


def expected_weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    h, inter = spec.hidden_size, spec.intermediate_size
    per_layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "pre_feedforward_layernorm.weight": (h,),
        "post_feedforward_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (spec.q_size, h),
        "self_attn.k_proj.weight": (spec.kv_size, h),
        "self_attn.v_proj.weight": (spec.kv_size, h),
        "self_attn.o_proj.weight": (h, spec.q_size),
        "self_attn.q_proj.bias": (spec.q_size,),
        "self_attn.k_proj.bias": (spec.kv_size,),
        "self_attn.v_proj.bias": (spec.kv_size,),
        "self_attn.q_norm.weight": (spec.head_dim,) if spec.qk_norm_span == "head" else (spec.q_size,),
        "self_attn.k_norm.weight": (spec.head_dim,) if spec.qk_norm_span == "head" else (spec.kv_size,),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
        "mlp.gate.weight": (spec.num_experts, h),
        "mlp.experts.gate_up_proj": (spec.num_experts, 2 * inter, h),
        "mlp.experts.down_proj": (spec.num_experts, h, inter),
        "mlp.shared_expert.gate_proj.weight": (spec.shared_expert_intermediate_size, h),
        "mlp.shared_expert.up_proj.weight": (spec.shared_expert_intermediate_size, h),
        "mlp.shared_expert.down_proj.weight": (h, spec.shared_expert_intermediate_size),
        "mlp.shared_expert_gate.weight": (1, h),
    }
    shapes = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (spec.vocab_size, h),
    }
    for name in expected_weight_names(spec):
        if name.startswith("model.layers."):
            shapes[name] = per_layer[name.split(".", 3)[3]]
    return shapes


def select_weights(spec: ModelSpec, weights: Mapping[str, torch.Tensor], source: str) -> Mapping[str, torch.Tensor]:
    """Check names and shapes against the spec; keep exactly the expected ones, as float32 (lazy weights stay
    lazy: their shapes come from the files' headers)."""
    shapes = expected_weight_shapes(spec)
    names = expected_weight_names(spec)
    missing = [n for n in names if n not in weights]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ValueError(f"{source}: weights missing for {', '.join(missing[:3])}{more}")
    # Anything else is a parameter the reference model would silently drop (o_proj bias, ...).
    unexpected = sorted(
        n for n in set(weights) - set(names)
        if n != "lm_head.weight" and not n.endswith("rotary_emb.inv_freq")
    )
    if unexpected:
        more = f" (and {len(unexpected) - 3} more)" if len(unexpected) > 3 else ""
        raise ValueError(f"{source}: unsupported weights {', '.join(unexpected[:3])}{more}")
    for name in names:
        shape = weight_shape(weights, name)
        if shape != shapes[name]:
            raise ValueError(f"{source}: {name} has shape {shape}, the config implies {shapes[name]}")
    if isinstance(weights, LazyWeights):
        return weights.subset(names)
    return {name: weights[name].to(torch.float32).contiguous() for name in names}
