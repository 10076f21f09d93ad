"""kiln.PagedAttention (domain "kiln", version 1): the contract and its executable spec.

Both kernels (the ONNX Runtime CPU custom op in runtime/ops/paged_attention.cc and the
TensorRT plugin) are tested against `paged_attention_ref` below, which takes the op's inputs and
attributes as the two frozen records `PagedAttentionInputs` and `PagedAttentionAttrs`.

Inputs
  query            float32 [T, H*D]       queries of the packed ragged batch (pre-RoPE iff cos/sin given)
  key              float32 [T, Hkv*D]     keys of the new tokens (pre-RoPE iff cos/sin given)
  value            float32 [T, Hkv*D]
  kv_cache         f32|f16|int8 [num_blocks, 2, Hkv, block_size, D]   one layer's pool; [:, 0] K, [:, 1] V
  block_tables     int32   [S, max_blocks]  physical block of each logical block, row-padded
  seq_lens         int32   [S]              context length of each sequence *after* this step
  query_start_loc  int32   [S+1]            cumulative token offsets: qsl[0] == 0, qsl[S] == T
  kv_scale         float32 [2, Hkv]         optional 8th input, present iff kv_cache is int8: the
                                            quantization step of each KV head, row 0 K, row 1 V
                                            (positive, finite; kiln's build uses calibrated absmax/127);
                                            a float pool with cos/sin gets an empty float32 [0] tensor
                                            in its place (not "": ORT's lite custom-op API crashes on a
                                            missing input before a trailing one)
  cos_cache        float32 [P, R/2]       optional 9th and 10th inputs, both or neither: cos and sin of
  sin_cache        float32 [P, R/2]       position p times rotary frequency j (rope scaling folded in at
                                            build time), for p < P; R = rotary dims (even, <= D)
  attend_until     int32   [T]            optional 11th input: the last context position each token may see
                                            (pos <= attend_until[t] < seq_lens[s]; an empty int32 [0] tensor,
                                            or no input, is the causal default attend_until[t] = pos). Gemma 3
                                            lets the tokens of one image see each other (bidirectional within the
                                            image's run): the runtime fills the run's last position for its
                                            tokens, so the whole run must be in one step. An op without kv_scale
                                            or cos/sin gets empty float32 [0] tensors in their places.
  q_norm           float32 [D] | [H*D]      optional 12th and 13th inputs, both or neither: RMSNorm weights of
  k_norm           float32 [D] | [Hkv*D]    the query and the key, applied first (before RoPE), per head ([D]:
                                            Qwen3, Gemma 3) or over the token's whole projection ([H*D], [Hkv*D]:
                                            OLMoE): x * w / sqrt(mean(x^2) + qk_norm_epsilon), the mean over the
                                            head's or the row's values (ONNX Runtime's SimplifiedLayerNormalization).
                                            The graph may instead apply the norms as standard ops and feed the
                                            normalised query and key; the ONNX Runtime lowering folds them into the
                                            op when it packs q, k and v (the TensorRT plugin's graphs keep them as
                                            graph ops, and the plugin does not take these inputs). An op with
                                            q_norm but without kv_scale, cos/sin or attend_until gets empty
                                            tensors in their places.
  Partial rotary (Phi-4-mini) is R < D in the caches, or RoPE left as graph ops ahead of the op.
  Packed QKV: key and value both empty float32 [0] -> query is [T, (H + 2*Hkv)*D], each token's row its H
  query heads, then its Hkv key heads, then its Hkv value heads (the fused QKV projection's output, read in
  place: no Split). Batch of one: query (and key/value unless packed) may be [1, T, width]; out is then
  [1, T, H*D] (the graph's packed batch keeps its leading 1, no Reshape around the op).
Outputs
  out              float32 [T, H*D]           ([1, T, H*D] for a rank-3 query)
  kv_cache_out     the pool's dtype and shape; the runtime binds one OrtValue to both kv_cache
                   and kv_cache_out, and the op then writes only the new tokens' slots.
Attributes
  num_heads (int), num_kv_heads (int, divides num_heads), scale (float; absent or 0 means
  1/sqrt(D)), sliding_window (int, 0 = off), softcap (float, absent or 0 = off: Gemma 2's attention logit
  soft-cap), qk_norm_epsilon (float, absent = 1e-6: read only with q_norm / k_norm), rotary_interleaved (int, 0 =
  Hugging Face rotate_half:
  dims j and j + R/2 form a pair, what Llama/Mistral/Qwen2 exports compute; 1 = GPT-J style adjacent pairs
  2j, 2j + 1; only read with cos/sin)
  Every attribute is per node, so each layer's op carries its own window, scale and soft-cap (Gemma 2 / 3
  alternate sliding and global layers); an absent attribute takes its default, so graphs written before an
  attribute existed run unchanged.

Semantics. Sequence s has q_len = qsl[s+1] - qsl[s] new tokens; its token i sits at the
absolute position pos = seq_lens[s] - q_len + i. With q_norm / k_norm its query and key are first normalised;
with cos/sin they are then rotated by RoPE at pos (pair (a, b) of dims -> (a c - b s, b c + a s), c = cos_cache[pos, j],
s = sin_cache[pos, j]; dims >= R pass through); pos >= P is an error. Then the K/V of every new token of every
sequence is written to block block_tables[s][pos // block_size], slot pos % block_size
(rounded to the pool's dtype; int8 pools store q = clamp(round_half_even(x / kv_scale[0|1][g]),
-127, 127) in float32 arithmetic, K post-RoPE). Then query head h of that token attends, through
KV head h // (H / Hkv), to every position p of its sequence with p <= pos (p <= attend_until[t]
when given; and p > pos - sliding_window when set, the window measured back from the token's own position:
transformers' Gemma 3 masks a sliding layer as AND(window, OR(causal, same image))), reading K/V from the
updated pool: out = softmax(s) V with the scores
s = scale * q.K^T, soft-capped to softcap * tanh(s / softcap) when softcap > 0 (before the causal mask).
For an int8 pool the steps factor out of the sums: scores = scale * kv_scale[0][g] * (q . float(k_i8)),
and out = kv_scale[1][g] * sum_j p_j float(v_i8_j) (i.e. attention over the dequantized K/V). Blocks
other than the new tokens' slots are left untouched. A sequence with q_len == 0 is allowed and does nothing.
Only the blocks a token can see are read (block-table entries before a sliding window or
past seq_lens may hold anything, e.g. -1). Invalid inputs are errors, never out-of-bounds reads.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kiln.contract import ATTEND_UNTIL, OP_DOMAIN, OP_TYPE, OP_VERSION

if TYPE_CHECKING:
    from onnx import ModelProto

INPUT_NAMES = ("query", "key", "value", "kv_cache", "block_tables", "seq_lens", "query_start_loc")
KV_SCALE = "kv_scale"  # the optional 8th input (int8 pools only)
ROTARY_INPUTS = ("cos_cache", "sin_cache")  # the optional 9th and 10th inputs (RoPE inside the op)
NO_KV_SCALE = "kv_scale.none"  # float32 [0]: the 8th input of a float pool that has cos/sin after it
NO_ROTARY = "rotary.none"  # float32 [0]: the 9th and 10th inputs of an op with attend_until but no RoPE inside
PACKED_QKV = "qkv.packed"  # float32 [0]: key and value of an op whose query holds packed Q|K|V
NO_ATTEND_UNTIL = "attend_until.none"  # int32 [0]: the 11th input of an op with q_norm / k_norm but no attend_until
QK_NORM_INPUTS = ("q_norm", "k_norm")  # the optional 12th and 13th inputs
QK_NORM_EPSILON = 1e-6  # the qk_norm_epsilon attribute's default
OUTPUT_NAMES = ("out", "kv_cache_out")
INT8_MAX = 127


@dataclass(frozen=True)
class PagedAttentionAttrs:
    """The op's node attributes, as the ONNX node carries them."""

    num_heads: int
    num_kv_heads: int
    scale: float = 0.0  # 0 means 1/sqrt(head_dim)
    sliding_window: int = 0  # 0 = off
    rotary_interleaved: int = 0  # 0: rotate_half pairs (j, j + R/2); 1: adjacent pairs (2j, 2j + 1)
    softcap: float = 0.0  # scores -> softcap * tanh(scores / softcap); 0 = off
    qk_norm_epsilon: float = QK_NORM_EPSILON  # read only with q_norm / k_norm

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0 or self.num_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a positive multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if not (math.isfinite(self.scale) and self.scale >= 0):
            raise ValueError(f"scale must be finite and >= 0 (0 means 1/sqrt(head_dim)), got {self.scale}")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 (0 = off), got {self.sliding_window}")
        if not (math.isfinite(self.softcap) and self.softcap >= 0):
            raise ValueError(f"softcap must be finite and >= 0 (0 = off), got {self.softcap}")
        if not (math.isfinite(self.qk_norm_epsilon) and self.qk_norm_epsilon > 0):
            raise ValueError(f"qk_norm_epsilon must be finite and > 0, got {self.qk_norm_epsilon}")
        if self.rotary_interleaved not in (0, 1):
            raise ValueError(f"rotary_interleaved must be 0 (rotate_half) or 1 (adjacent pairs), "
                             f"got {self.rotary_interleaved}")


@dataclass(frozen=True)
class QkvLayout:
    """How the op's inputs arrive: query, key and value packed into one query (key and value empty), with a
    leading 1; and (for make_single_op_model) whether the op takes attend_until, and q_norm / k_norm."""

    packed: bool = False
    batch_of_one: bool = False
    attend_until: bool = False
    qk_norm: bool = False


@dataclass(frozen=True)
class PagedAttentionInputs:
    """The op's inputs by their graph names (so a feeds dict unpacks into it); kv_scale only with an int8 pool,
    cos_cache and sin_cache together or not at all."""

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    kv_cache: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    kv_scale: np.ndarray | None = None
    cos_cache: np.ndarray | None = None
    sin_cache: np.ndarray | None = None
    attend_until: np.ndarray | None = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None

    def __post_init__(self) -> None:
        if (self.kv_cache.dtype == np.int8) != (self.kv_scale is not None):
            raise ValueError("kv_scale [2, num_kv_heads] is required with an int8 kv_cache and only then")
        if self.kv_scale is not None:
            steps, num_kv_heads = np.asarray(self.kv_scale, np.float32), self.kv_cache.shape[2]
            if steps.shape != (2, num_kv_heads) or not (np.isfinite(steps).all() and (steps > 0).all()):
                raise ValueError(f"kv_scale must be positive finite [2, {num_kv_heads}], got {steps.shape}")
        if (self.cos_cache is None) != (self.sin_cache is None):
            raise ValueError("cos_cache and sin_cache come together: RoPE needs both or neither")
        if self.cos_cache is not None and self.sin_cache is not None:
            half, head_dim = self.cos_cache.shape[-1], self.kv_cache.shape[4]
            if self.cos_cache.ndim != 2 or self.sin_cache.shape != self.cos_cache.shape or not 0 < 2 * half <= head_dim:
                raise ValueError(f"cos_cache and sin_cache must both be [P, R/2] with 0 < R <= head_dim {head_dim}, "
                                 f"got {self.cos_cache.shape} and {self.sin_cache.shape}")
        if self.attend_until is not None and self.attend_until.shape != (0,):  # empty: the causal default
            check_attend_until(self.attend_until, self.seq_lens, self.query_start_loc)
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("q_norm and k_norm come together: both or neither")


def check_attend_until(attend_until: np.ndarray, seq_lens: np.ndarray, query_start_loc: np.ndarray) -> None:
    """ValueError unless every token's last visible position is at or after its own and inside its context."""
    positions = token_positions(seq_lens, query_start_loc)
    if attend_until.shape != positions.shape:
        raise ValueError(f"attend_until must be int32 [T] = [{len(positions)}], got {attend_until.shape}")
    ends = np.repeat(seq_lens.astype(np.int64), np.diff(query_start_loc))
    if ((attend_until < positions) | (attend_until >= ends)).any():
        raise ValueError("attend_until[t] must be in [position of t, seq_lens of its sequence - 1]")


def quantize_kv(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """int8 KV of x [..., Hkv, D] with per-head steps [Hkv]: clamp(round_half_even(x / step), -127, 127)."""
    q: np.ndarray = np.rint(x.astype(np.float32) / step.astype(np.float32)[:, None])
    return q.clip(-INT8_MAX, INT8_MAX).astype(np.int8)


def token_positions(seq_lens: np.ndarray, query_start_loc: np.ndarray) -> np.ndarray:
    """Absolute position of every token of the packed batch, int64 [T]."""
    q_lens = np.diff(query_start_loc).tolist()
    spans = [np.arange(L - n, L, dtype=np.int64) for L, n in zip(seq_lens.tolist(), q_lens, strict=True)]
    return np.concatenate(spans) if spans else np.zeros(0, np.int64)


def apply_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: int) -> np.ndarray:
    """RoPE of x [T, heads, D] with cos/sin [T, R/2] (the rows of each token's position), float32."""
    half = cos.shape[-1]
    out = x.astype(np.float32)  # a copy: dims >= R pass through
    c, s = cos[:, None, :].astype(np.float32), sin[:, None, :].astype(np.float32)
    if interleaved:
        first, second = slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    else:
        first, second = slice(0, half), slice(half, 2 * half)
    a, b = x[..., first].astype(np.float32), x[..., second].astype(np.float32)
    out[..., first], out[..., second] = a * c - b * s, b * c + a * s
    return out


def rms_norm_heads(x: np.ndarray, weight: np.ndarray, heads: int, epsilon: float) -> np.ndarray:
    """x [T, heads*D] RMS-normalised per head (weight [D]) or per row (weight [heads*D]), in float64; float32."""
    T, width = x.shape
    if weight.ndim != 1 or weight.shape[0] not in (width // heads, width):
        raise ValueError(f"a q/k norm weight must be [D={width // heads}] (per head) or [{width}] (the whole "
                         f"projection), got {list(weight.shape)}")
    groups = x.reshape(T, -1, weight.shape[0]).astype(np.float64)
    mean_square = (groups * groups).mean(axis=-1, keepdims=True)
    normed: np.ndarray = groups / np.sqrt(mean_square + epsilon) * weight.astype(np.float64)
    return normed.astype(np.float32).reshape(T, width)


def norm_query_key(inputs: PagedAttentionInputs, attrs: PagedAttentionAttrs) -> PagedAttentionInputs:
    """inputs with the query and key RMS-normalised by q_norm / k_norm (unchanged without them)."""
    if inputs.q_norm is None or inputs.k_norm is None:
        return inputs
    epsilon = attrs.qk_norm_epsilon
    return dataclasses.replace(inputs, query=rms_norm_heads(inputs.query, inputs.q_norm, attrs.num_heads, epsilon),
                               key=rms_norm_heads(inputs.key, inputs.k_norm, attrs.num_kv_heads, epsilon))


def rotate_query_key(inputs: PagedAttentionInputs, attrs: PagedAttentionAttrs) -> tuple[np.ndarray, np.ndarray]:
    """query [T, H*D] and key [T, Hkv*D] rotated at each token's position (unchanged without cos/sin)."""
    cos, sin = inputs.cos_cache, inputs.sin_cache
    if cos is None or sin is None:
        return inputs.query, inputs.key
    positions = token_positions(inputs.seq_lens, inputs.query_start_loc)
    if positions.size and positions.max() >= len(cos):
        raise ValueError(f"position {positions.max()} is past the cos/sin cache ({len(cos)} positions)")
    T = inputs.query.shape[0]
    D = inputs.query.shape[1] // attrs.num_heads
    rows = (cos[positions], sin[positions], attrs.rotary_interleaved)
    query = apply_rotary(inputs.query.reshape(T, attrs.num_heads, D), *rows).reshape(T, -1)
    key = apply_rotary(inputs.key.reshape(T, attrs.num_kv_heads, D), *rows).reshape(T, -1)
    return query, key


def separate_qkv(inputs: PagedAttentionInputs, attrs: PagedAttentionAttrs) -> PagedAttentionInputs:
    """inputs with query [T, H*D], key and value [T, Hkv*D]: a packed query split, a leading 1 dropped."""
    query, key, value = inputs.query, inputs.key, inputs.value
    packed = key.shape == (0,)  # an empty [0] tensor, not [0, width] (a batch without tokens)
    if packed != (value.shape == (0,)):
        raise ValueError("key and value are both empty (packed query) or both present")
    if query.ndim == 3:
        if query.shape[0] != 1:
            raise ValueError(f"a rank-3 query must be [1, T, width] (the batch of one), got {query.shape}")
        query = query[0]
        key, value = (key, value) if packed else (key[0], value[0])
    if packed:
        heads = attrs.num_heads + 2 * attrs.num_kv_heads
        if query.ndim != 2 or query.shape[1] % heads:
            raise ValueError(f"a packed query must be [T, (H + 2*Hkv)*D] = [T, {heads}*D], got {query.shape}")
        q_width = attrs.num_heads * (query.shape[1] // heads)
        kv_width = (query.shape[1] - q_width) // 2
        query, key, value = query[:, :q_width], query[:, q_width:q_width + kv_width], query[:, q_width + kv_width:]
    return dataclasses.replace(inputs, query=query, key=key, value=value)


def paged_attention_ref(inputs: PagedAttentionInputs, attrs: PagedAttentionAttrs) -> tuple[np.ndarray, np.ndarray]:
    """The executable spec: returns (out float32 [T, H*D] or [1, T, H*D], the updated copy of kv_cache)."""
    out, pool = _attention_ref(separate_qkv(inputs, attrs), attrs)
    return (out[None] if inputs.query.ndim == 3 else out), pool


def _attention_ref(inputs: PagedAttentionInputs, attrs: PagedAttentionAttrs) -> tuple[np.ndarray, np.ndarray]:
    """paged_attention_ref of separate rank-2 query, key and value."""
    inputs = norm_query_key(inputs, attrs)
    query, key = rotate_query_key(inputs, attrs)
    kv_cache, block_tables = inputs.kv_cache, inputs.block_tables
    seq_lens, query_start_loc = inputs.seq_lens, inputs.query_start_loc
    num_heads, num_kv_heads = attrs.num_heads, attrs.num_kv_heads
    steps = None if inputs.kv_scale is None else np.asarray(inputs.kv_scale, np.float32)
    T = query.shape[0]
    D = query.shape[1] // num_heads
    group = num_heads // num_kv_heads
    block_size = kv_cache.shape[3]
    scale = attrs.scale or 1.0 / np.sqrt(D)
    pool = kv_cache.copy()
    out = np.zeros((T, num_heads * D), dtype=np.float32)
    positions = token_positions(seq_lens, query_start_loc)
    seq_of_token = np.repeat(np.arange(len(seq_lens)), np.diff(query_start_loc))
    bounds = inputs.attend_until  # None or empty: causal
    bounds = None if bounds is None or bounds.shape == (0,) else bounds.astype(np.int64)
    blocks, slots = block_tables[seq_of_token, positions // block_size], positions % block_size
    new_k, new_v = key.reshape(T, num_kv_heads, D), inputs.value.reshape(T, num_kv_heads, D)
    if steps is not None:
        new_k, new_v = quantize_kv(new_k, steps[0]), quantize_kv(new_v, steps[1])
    pool[blocks, 0, :, slots, :] = new_k  # all writes first, then all reads
    pool[blocks, 1, :, slots, :] = new_v
    for s in range(len(seq_lens)):
        t0, t1 = int(query_start_loc[s]), int(query_start_loc[s + 1])
        q_len, L = t1 - t0, int(seq_lens[s])
        if q_len == 0:
            continue
        new_pos = positions[t0:t1]
        ctx = np.arange(L)
        k = pool[block_tables[s, ctx // block_size], 0, :, ctx % block_size, :].astype(np.float64)  # [L, Hkv, D]
        v = pool[block_tables[s, ctx // block_size], 1, :, ctx % block_size, :].astype(np.float64)
        if steps is not None:  # == scaling the scores by the K step and the output by the V step
            k, v = k * steps[0, None, :, None], v * steps[1, None, :, None]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [L, H, D]
        q = query[t0:t1].reshape(q_len, num_heads, D).astype(np.float64)
        scores = np.einsum("qhd,khd->hqk", q, k) * scale
        if attrs.softcap > 0:
            scores = np.tanh(scores / attrs.softcap) * attrs.softcap
        until = new_pos if bounds is None else bounds[t0:t1]
        allowed = ctx[None, :] <= until[:, None]
        if attrs.sliding_window > 0:
            allowed &= ctx[None, :] > new_pos[:, None] - attrs.sliding_window
        scores = np.where(allowed[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out[t0:t1] = np.einsum("hqk,khd->qhd", probs, v).reshape(q_len, num_heads * D)
    return out, pool


def make_single_op_model(
    attrs: PagedAttentionAttrs, head_dim: int, block_size: int, kv_dtype: npt.DTypeLike = np.float32,
    rotary: bool = False, layout: QkvLayout | None = None,
) -> ModelProto:
    """A one-node ONNX model running kiln.PagedAttention with `attrs`, for tests and benchmarks.

    An int8 kv_dtype adds the graph input kv_scale [2, num_kv_heads] feeding the op's 8th input;
    rotary adds the graph inputs cos_cache and sin_cache [P, R/2] (the 9th and 10th; a float pool's 8th input
    is then the empty initializer NO_KV_SCALE); layout.packed makes the graph input query [T, (H + 2*Hkv)*D] and
    feeds key and value the empty initializer PACKED_QKV (no key/value graph inputs); layout.batch_of_one gives
    query (and key/value) and out a leading dim of 1; layout.attend_until adds the graph input attend_until [T]
    (the 11th, with empty initializers NO_KV_SCALE / NO_ROTARY before it where the op has no kv_scale or cos/sin);
    layout.qk_norm adds the graph inputs q_norm and k_norm (the 12th and 13th, their widths symbolic: [D] or the
    projection's; empty initializers in the optional places before them) and the attribute qk_norm_epsilon.
    Graph inputs and outputs carry the op's own input/output names; token, block and
    sequence counts are symbolic dims.
    """
    from onnx import TensorProto, helper, numpy_helper  # compile-time dependency only

    kv_type = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
               np.dtype(np.int8): TensorProto.INT8}[np.dtype(kv_dtype)]
    int8 = kv_type == TensorProto.INT8
    q_width, kv_width = attrs.num_heads * head_dim, attrs.num_kv_heads * head_dim
    pool: list[str | int] = ["num_blocks", 2, attrs.num_kv_heads, block_size, head_dim]
    layout = layout or QkvLayout()
    attend_until, qk_norm = layout.attend_until, layout.qk_norm
    lead: list[str | int] = [1, "T"] if layout.batch_of_one else ["T"]
    width = q_width + 2 * kv_width * layout.packed
    inputs = [helper.make_tensor_value_info("query", TensorProto.FLOAT, [*lead, width])]
    if not layout.packed:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [*lead, kv_width]) for n in ("key", "value")]
    inputs += [
        helper.make_tensor_value_info("kv_cache", kv_type, pool),
        helper.make_tensor_value_info("block_tables", TensorProto.INT32, ["S", "max_blocks"]),
        helper.make_tensor_value_info("seq_lens", TensorProto.INT32, ["S"]),
        helper.make_tensor_value_info("query_start_loc", TensorProto.INT32, ["S1"]),
    ]
    op_inputs = list(INPUT_NAMES)
    initializers = []
    if layout.packed:
        op_inputs[1:3] = [PACKED_QKV, PACKED_QKV]
        initializers.append(numpy_helper.from_array(np.zeros(0, np.float32), PACKED_QKV))
    if int8 or rotary or attend_until or qk_norm:
        op_inputs.append(KV_SCALE if int8 else NO_KV_SCALE)
    if (rotary or attend_until or qk_norm) and not int8:
        initializers.append(numpy_helper.from_array(np.zeros(0, np.float32), NO_KV_SCALE))
    if int8:
        inputs.append(helper.make_tensor_value_info(KV_SCALE, TensorProto.FLOAT, [2, attrs.num_kv_heads]))
    if rotary:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["P", "half_rotary"]) for n in ROTARY_INPUTS]
        op_inputs += ROTARY_INPUTS
    elif attend_until or qk_norm:
        op_inputs += [NO_ROTARY, NO_ROTARY]
        initializers.append(numpy_helper.from_array(np.zeros(0, np.float32), NO_ROTARY))
    if attend_until:
        inputs.append(helper.make_tensor_value_info(ATTEND_UNTIL, TensorProto.INT32, ["T_until"]))
        op_inputs.append(ATTEND_UNTIL)
    elif qk_norm:
        op_inputs.append(NO_ATTEND_UNTIL)
        initializers.append(numpy_helper.from_array(np.zeros(0, np.int32), NO_ATTEND_UNTIL))
    if qk_norm:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [f"{n}_width"]) for n in QK_NORM_INPUTS]
        op_inputs += QK_NORM_INPUTS
    outputs = [
        helper.make_tensor_value_info("out", TensorProto.FLOAT, [*lead, q_width]),
        helper.make_tensor_value_info("kv_cache_out", kv_type, pool),
    ]
    node = helper.make_node(
        OP_TYPE,
        op_inputs,
        list(OUTPUT_NAMES),
        domain=OP_DOMAIN,
        num_heads=attrs.num_heads,
        num_kv_heads=attrs.num_kv_heads,
        scale=float(attrs.scale),
        sliding_window=attrs.sliding_window,
    )
    if rotary:
        node.attribute.append(helper.make_attribute("rotary_interleaved", attrs.rotary_interleaved))
    if attrs.softcap:
        node.attribute.append(helper.make_attribute("softcap", float(attrs.softcap)))
    if qk_norm:
        node.attribute.append(helper.make_attribute("qk_norm_epsilon", float(attrs.qk_norm_epsilon)))
    graph = helper.make_graph([node], "kiln_paged_attention", inputs, outputs, initializers)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(OP_DOMAIN, OP_VERSION)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)
