"""Attention subgraph -> kiln.PagedAttention.

Matches scaled dot-product attention as exporters write it,

    Softmax(cap((Q * sq) @ (K^T * sk) * s) + mask) @ V      (each scale, the cap and the mask optional)

with K^T as Transpose(K, [0,1,3,2]), Reshape-Transpose-Reshape (torch's SDPA decomposition),
or Transpose(K_bshd, [0,2,3,1]), an optional Where(IsNaN(p), 0, p) after the Softmax, and K/V
possibly expanded by repeat_kv (looked through to the un-repeated [1, Hkv, T, D] tensors).
cap(x) is Gemma 2's logit soft-cap Mul(Tanh(Div(x, c)), c), which becomes the op's softcap attribute.
The mask (causal, from position_ids) is dropped: the op masks by absolute position itself,
so the mask computation becomes dead code and is removed by the cleanup. Its window comes from
AttentionConfig.sliding_window: one for every layer, or one per fused layer (Gemma's sliding and global
layers), since the op carries its window, scale and soft-cap per node.

The replacement feeds the op Q/K/V as [T, H*D] / [T, Hkv*D], reshapes its [T, H*D] output
back to [1, H, T, D], and adds the graph inputs kv_cache.{i} (+ the shared query_start_loc,
seq_lens, block_tables) and outputs kv_cache_out.{i}, i counting fused layers in graph order.
With an int8 KV cache each op also reads an initializer kv_scale.{i} [2, Hkv] (the per-head K and
V quantization steps of layer i, from AttentionConfig.kv_scales) as its 8th input.

With AttentionConfig.rotary_positions > 0 (kiln's build: max_seq_len), RoPE moves into the op: when
both Q and K are RoPE(x) (kiln/optimize/rotary.py) with the same frequencies, the op gets the
pre-RoPE projections plus the initializers rotary.cos / rotary.sin [rotary_positions, D/2] (shared by
all layers with those frequencies; a second set, as Gemma 3's sliding layers rotate at their own base, gets
rotary.cos.1 / rotary.sin.1, and so on) as its 9th and 10th inputs, and the rotary subgraph dies with the
mask (cleanup removes it). A float pool's 8th input is then the empty initializer kiln.paged_attention.NO_KV_SCALE.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from kiln import contract
from kiln.errors import require
from kiln.optimize._common import add_opset, const_float, float_initializer, look_through_repeat_kv, static_dim
from kiln.optimize.rotary import match_rotary, rotary_tables
from kiln.paged_attention import NO_KV_SCALE

ROTARY_COS, ROTARY_SIN = "rotary.cos", "rotary.sin"


def kv_scale_name(layer: int) -> str:
    return f"kv_scale.{layer}"


@dataclass(frozen=True)
class AttentionConfig:
    kv_dtype: str = "float32"
    block_size: int = 16
    sliding_window: int | tuple[int, ...] = 0  # every layer's, or one per fused layer in graph order
    # int8 KV only: float32 [num_layers, 2, Hkv], the K (row 0) and V (row 1) steps of each layer
    kv_scales: np.ndarray | None = None
    # rows of the op's cos/sin caches (positions the engine may reach); 0 keeps RoPE as graph ops
    rotary_positions: int = 2048

    def window(self, layer: int) -> int:
        """The sliding window of fused layer `layer` (0: full attention)."""
        if isinstance(self.sliding_window, int):
            return self.sliding_window
        if layer >= len(self.sliding_window):
            raise ValueError(f"sliding_window names {len(self.sliding_window)} layers; attention layer {layer} "
                             "has none")
        return self.sliding_window[layer]

    def __post_init__(self) -> None:
        windows = (self.sliding_window,) if isinstance(self.sliding_window, int) else self.sliding_window
        require(all(isinstance(w, int) and w >= 0 for w in windows), "sliding_window",
                "an int >= 0 or a tuple of them (0 = full attention)", self.sliding_window)
        require(isinstance(self.rotary_positions, int) and self.rotary_positions >= 0, "rotary_positions",
                "an int >= 0 (0 = RoPE outside the op)", self.rotary_positions)
        scales = self.kv_scales
        found = f"{scales.dtype} {list(scales.shape)}" if isinstance(scales, np.ndarray) else scales
        if self.kv_dtype != "int8":
            require(scales is None, "kv_scales", f"None with a {self.kv_dtype} KV cache", found)
        else:
            require(isinstance(scales, np.ndarray) and scales.dtype == np.float32 and scales.ndim == 3
                    and scales.shape[1] == 2, "kv_scales", "float32 [num_layers, 2, Hkv] with an int8 KV cache", found)


@dataclass
class _Layer:
    kv_cache: ir.Value
    kv_cache_out: ir.Value
    kv_scale: ir.Value | None = None


@dataclass(frozen=True)
class _Match:
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    softcap: float  # 0: none
    rotary: tuple[ir.Value, ir.Value, str] | None  # pre-RoPE query and key, and the tables' suffix, when RoPE moves in


class PagedAttentionFusion(pattern.RewriteRuleClassBase):
    def __init__(self, config: AttentionConfig, shared: dict[str, ir.Value], layers: list[_Layer]):
        super().__init__("PagedAttentionFusion")
        self._config = config
        self._shared = shared  # graph inputs, and the constants every layer reads (registered after the rewrite)
        self._layers = layers
        self._tables: dict[bytes, str] = {}  # RoPE frequencies -> the suffix of their cos/sin initializers

    # onnxscript binds one parameter per pattern input by name: the signature is the pattern's inputs.
    def pattern(self, op, query, key, value, mask, query_scale, key_scale, qk_scale, cap_in, cap_out):  # noqa: PLR0913
        key_t = pattern.OrValue(
            [
                op.Transpose(key, perm=[0, 1, 3, 2]),
                op.Reshape(op.Transpose(op.Reshape(key, pattern.ANY_VALUE), perm=[0, 2, 1]), pattern.ANY_VALUE),
                op.Transpose(key, perm=[0, 2, 3, 1]),
            ],
            tag_var="key_format",
            tag_values=["BHSd", "BHSd", "BSHd"],
        )
        query = pattern.OrValue(
            [op.Mul(query, query_scale), op.Div(query, query_scale), query],
            tag_var="query_scaling", tag_values=["Mul", "Div", "None"],
        )
        key_t = pattern.OrValue(
            [op.Mul(key_t, key_scale), op.Div(key_t, key_scale), key_t],
            tag_var="key_scaling", tag_values=["Mul", "Div", "None"],
        )
        scores = op.MatMul(query, key_t)
        scores = pattern.OrValue(
            [op.Mul(scores, qk_scale), op.Div(scores, qk_scale), scores],
            tag_var="qk_scaling", tag_values=["Mul", "Div", "None"],
        )
        scores = pattern.OrValue([op.Mul(op.Tanh(op.Div(scores, cap_in)), cap_out), scores],
                                 tag_var="capped", tag_values=[True, False])
        scores = pattern.OrValue([op.Add(scores, mask), scores])
        probs = op.Softmax(scores, axis=-1)
        probs = pattern.OrValue([op.Where(op.IsNaN(probs), 0.0, probs), probs])
        return op.MatMul(probs, value)

    def _kv_scale(self, layer: int, kv_heads: int) -> ir.Value:
        """The initializer kv_scale.{layer} [2, Hkv] (registered on the graph after the rewrite)."""
        scales = self._config.kv_scales
        if scales is None or layer >= len(scales):
            raise ValueError(f"an int8 KV cache needs kv_scales for layer {layer}")
        steps = np.ascontiguousarray(np.asarray(scales[layer], np.float32))
        if steps.shape != (2, kv_heads):
            raise ValueError(f"kv_scales[{layer}] must be [2, {kv_heads}], got {list(steps.shape)}")
        tensor = ir.tensor(steps, name=kv_scale_name(layer))
        return ir.Value(name=kv_scale_name(layer), type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, kv_heads]),
                        const_value=tensor)

    def check(self, context, query, key, value, key_format, **bindings) -> pattern.MatchResult:
        result = pattern.MatchResult()
        bindings["key"] = key
        if key_format != "BHSd":
            key = None  # BSHd keys are not repeated; shapes checked below
        heads, head_dim = static_dim(query, 1), static_dim(query, 3)
        if heads is None or head_dim is None or len(query.shape) != 4:
            return result.fail("query is not [B, H, T, D] with static H and D", query)
        if static_dim(query, 0) != 1:
            return result.fail("batch is not 1 (kiln traces a packed batch of one)", query)
        k = look_through_repeat_kv(key) if key is not None else None
        v = look_through_repeat_kv(value)
        kv_heads = static_dim(v, 1)
        if kv_heads is None or static_dim(v, 3) != head_dim:
            return result.fail("value is not [B, Hkv, T, D] with static Hkv and the query's D", v)
        if k is not None and (static_dim(k, 1) != kv_heads or static_dim(k, 3) != head_dim):
            return result.fail("key and value disagree on [Hkv, D] after looking through repeat_kv", k)
        if key is None and (static_dim(bindings["key"], 2) != kv_heads or static_dim(bindings["key"], 3) != head_dim):
            return result.fail("a [B, S, Hkv, D] key does not match the value's [Hkv, D]", bindings["key"])
        if heads % kv_heads:
            return result.fail(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
        scale = 1.0
        for tag, name in (("query_scaling", "query_scale"), ("key_scaling", "key_scale"), ("qk_scaling", "qk_scale")):
            kind = bindings.get(tag, "None")
            if kind == "None":
                continue
            number = const_float(bindings.get(name))
            if number is None:
                return result.fail(f"{name} is not a constant scalar", bindings.get(name))
            scale *= number if kind == "Mul" else 1.0 / number
        softcap = 0.0
        if bindings.get("capped"):
            cap = const_float(bindings.get("cap_in"))
            if cap is None or cap <= 0 or cap != const_float(bindings.get("cap_out")):
                return result.fail("Mul(Tanh(Div(s, c)), c) with c not one positive constant", bindings.get("cap_in"))
            softcap = cap
        self._match = _Match(heads, kv_heads, head_dim, scale, softcap, self._rotary(query, k, head_dim))
        return result

    def _rotary(self, query: ir.Value, key: ir.Value | None, head_dim: int
                ) -> tuple[ir.Value, ir.Value, str] | None:
        """Pre-RoPE (query, key) and the suffix of the cos/sin caches of their frequencies (made on first use),
        if both are RoPE'd with the same frequencies, else None."""
        if self._config.rotary_positions == 0 or key is None:
            return None
        q, k = match_rotary(query), match_rotary(key)
        if q is None or k is None or 2 * len(q.inv_freq) != head_dim or not np.array_equal(q.inv_freq, k.inv_freq):
            return None
        freqs = np.ascontiguousarray(q.inv_freq, np.float32).tobytes()
        if freqs not in self._tables:
            suffix = f".{len(self._tables)}" if self._tables else ""
            self._tables[freqs] = suffix
            cos, sin = rotary_tables(q.inv_freq, self._config.rotary_positions)
            self._shared[ROTARY_COS + suffix] = float_initializer(ROTARY_COS + suffix, cos)
            self._shared[ROTARY_SIN + suffix] = float_initializer(ROTARY_SIN + suffix, sin)
        return q.source, k.source, self._tables[freqs]

    def rewrite(self, op, query, key, value, key_format, **_):
        match: _Match = self._match
        heads, kv_heads, head_dim, scale = match.heads, match.kv_heads, match.head_dim, match.scale
        if match.rotary is not None:
            query, key = match.rotary[0], _to_tokens(op, match.rotary[1], kv_heads * head_dim)
        elif key_format == "BHSd":
            key = _to_tokens(op, look_through_repeat_kv(key), kv_heads * head_dim)
        else:  # [B, S, Hkv, D]
            key = op.Reshape(key, op.Constant(value_ints=[-1, kv_heads * head_dim]))
        value = _to_tokens(op, look_through_repeat_kv(value), kv_heads * head_dim)
        query = _to_tokens(op, query, heads * head_dim)

        layer = len(self._layers)
        cfg = self._config
        kv_cache = ir.Value(
            name=contract.kv_cache_input(layer),
            type=ir.TensorType(ir.DataType.from_numpy(contract.KV_DTYPES[cfg.kv_dtype])),
            shape=ir.Shape(["num_blocks", 2, kv_heads, cfg.block_size, head_dim]),
        )
        extra = []
        if cfg.kv_dtype == "int8":
            extra.append(self._kv_scale(layer, kv_heads))
        shared = self._shared
        if match.rotary is not None:
            if not extra:
                shared.setdefault(NO_KV_SCALE, float_initializer(NO_KV_SCALE, np.zeros(0, np.float32)))
            suffix = match.rotary[2]
            extra = [extra[0] if extra else shared[NO_KV_SCALE], shared[ROTARY_COS + suffix],
                     shared[ROTARY_SIN + suffix]]
        optional: dict[str, float | int] = {"softcap": match.softcap} if match.softcap else {}
        if match.rotary is not None:
            optional["rotary_interleaved"] = 0
        out, kv_cache_out = op.PagedAttention(
            query, key, value, kv_cache,
            shared[contract.BLOCK_TABLES], shared[contract.SEQ_LENS], shared[contract.QUERY_START_LOC],
            *extra,
            num_heads=heads, num_kv_heads=kv_heads, scale=float(scale), sliding_window=cfg.window(layer),
            **optional,
            _domain=contract.OP_DOMAIN, _version=contract.OP_VERSION, _outputs=2,
        )
        kv_cache_out.name = contract.kv_cache_output(layer)
        kv_cache_out.type = kv_cache.type
        kv_cache_out.shape = kv_cache.shape
        self._layers.append(_Layer(kv_cache, kv_cache_out, extra[0] if cfg.kv_dtype == "int8" else None))
        out = op.Reshape(out, op.Constant(value_ints=[1, -1, heads, head_dim]))
        return op.Transpose(out, perm=[0, 2, 1, 3])


def _to_tokens(op, x, width: int):
    """[1, H, T, D] -> [T, H*D]."""
    return op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), op.Constant(value_ints=[-1, width]))


def fuse_attention(model: ir.Model, config: AttentionConfig = AttentionConfig()) -> int:
    """Replace every attention subgraph; add the paged-KV graph inputs/outputs. Returns the count."""
    graph = model.graph
    int32 = ir.TensorType(ir.DataType.INT32)
    shapes = {
        contract.QUERY_START_LOC: ["num_seqs_plus_1"],
        contract.SEQ_LENS: ["num_seqs"],
        contract.BLOCK_TABLES: ["num_seqs", "max_blocks"],
    }
    shared = {name: ir.Value(name=name, type=int32, shape=ir.Shape(dims)) for name, dims in shapes.items()}
    layers: list[_Layer] = []
    rule = PagedAttentionFusion.rule(config, shared, layers)
    count = pattern.RewriteRuleSet([rule]).apply_to_model(model)
    if count:
        add_opset(model, contract.OP_DOMAIN, contract.OP_VERSION)
        graph.inputs.extend(shared[name] for name in shapes)  # query_start_loc, seq_lens, block_tables
        for name, value in shared.items():
            if name == NO_KV_SCALE or name.startswith((ROTARY_COS, ROTARY_SIN)):
                graph.register_initializer(value)
        graph.inputs.extend(layer.kv_cache for layer in layers)
        graph.outputs.extend(layer.kv_cache_out for layer in layers)
        for layer in layers:
            if layer.kv_scale is not None:
                graph.register_initializer(layer.kv_scale)
        if config.kv_dtype == "int8" and config.kv_scales is not None and len(config.kv_scales) != count:
            raise ValueError(f"kv_scales has {len(config.kv_scales)} layers but {count} attention layers were fused")
    return count
