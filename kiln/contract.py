"""The graph contract shared by the optimizer (which produces it) and the runtime (which feeds it).

The optimized graph works on a *packed ragged batch*: the new tokens of every scheduled
sequence are concatenated into one axis of length num_tokens, without padding.

Inputs
  input_ids        int64  [num_tokens]
  position_ids     int64  [num_tokens]            absolute position of each token (RoPE outside the op)
  query_start_loc  int32  [num_seqs + 1]          cumulative token offsets; [0] == 0
  seq_lens         int32  [num_seqs]              context length of each sequence *after* this step
  block_tables     int32  [num_seqs, max_blocks]  physical block ids of each sequence, row-padded
  logits_indices   int64  [num_logits]            rows of the packed batch that need logits
  medusa_indices   int64  [num_medusa]            rows that need Medusa heads' logits (engines built with --medusa only;
                                                  typically every logits row of the sequences that speculate)
  kv_cache.{i}     kv dtype [num_blocks, 2, num_kv_heads, block_size, head_dim]   one pool per layer
                   (a KV_DTYPES value; the runtime picks num_blocks, KvPoolSpec fixes the rest)

Outputs
  logits           float32 [num_logits, vocab_size]
  medusa_logits    float32 [num_medusa, K, vocab_size]   head i's logits at medusa_indices[r] in [r, i-1]
                   (engines built with --medusa only; kiln/medusa.py specifies the heads)
  medusa_hidden    float32 [num_medusa, hidden_size]     instead of medusa_logits for hydra heads: the final
                   norm's output at medusa_indices (their draft graph runs the heads after the step)
  kv_cache_out.{i} the same buffer as kv_cache.{i}: the runtime binds one OrtValue to both,
                   and kiln.PagedAttention writes the new tokens' K/V in place.

The op itself (kiln.PagedAttention, domain "kiln", version 1) is specified, with its numpy
reference implementation, in kiln/paged_attention.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

OP_DOMAIN = "kiln"
OP_TYPE = "PagedAttention"
OP_VERSION = 1
# Bumped whenever the custom-op library's inputs, attributes or KV layout change.
# 2: int8 KV pools and the optional 8th input kv_scale [2, Hkv].
# 3: RoPE inside the op (optional 9th/10th inputs cos_cache, sin_cache and the rotary_interleaved attribute)
#    and the kiln.MatMulQ4_1 op (kiln/matmul_q4_1.py), which int4-q4_1 engines use.
# 4: the kiln.SwiGLU op (kiln/swiglu.py), which every engine's MLPs use.
# 5: the kiln.RescoreLogits op (kiln/rescore_logits.py), which int4-rescored LM heads use.
# 6: kiln.PagedAttention's softcap attribute (Gemma 2's attention logit soft-cap: an older library would
#    ignore it and compute uncapped attention, so engines that carry it need this one), the kiln.MoE op
#    (kiln/moe.py), which mixture-of-experts models' MLPs use, and kiln.MatMulGGUF (a GGUF's own blocks).
# 7: the kiln.AllReduce op (kiln/all_reduce.py), which tensor-parallel engines' rank graphs use.
# 8: kiln.PagedAttention's optional 11th input attend_until (Gemma 3's bidirectional image runs: an older
#    library would ignore it and attend causally only, so engines that carry it need this one).
# 9: kiln.MatMulQ4_1's layout attribute: "records" weights are the kernel's own 320-byte records, stored in the
#    engine and read where ONNX Runtime maps them (kiln/matmul_q4_1.py); int4-q4_1 and gguf engines hold them.
# 10: kiln.MoE's GGUF experts (the gate_type, up_type and down_type attributes: a GGUF file's expert blocks as they
#     are, kiln/moe_gguf.py); `gguf` engines of mixture-of-experts GGUF files hold them.
# 11: kiln.MoE's layout attribute: "records" Q4_1 experts are kiln.MatMulQ4_1's records, expert after expert, stored
#     in the engine and read where ONNX Runtime maps them (kiln/moe.py); int4-q4_1 engines of mixture-of-experts
#     models hold them.
# 12: kiln.MatMulGGUF's layout attribute and kiln.MoE's for GGUF experts: "records" Q4_K / Q6_K weights are
#     kiln.MatMulQ4_1's records, 8 blocks of 32 a superblock, stored in the engine and read where ONNX Runtime maps
#     them (kiln/gguf_records.py, kiln/moe_gguf.py); `gguf` engines of files with Q4_K or Q6_K matrices hold them.
# 13: kiln.PagedAttention's optional q_norm / k_norm inputs (12th, 13th) and qk_norm_epsilon attribute.
# 14: Q5_K and Q8_0 records (kiln.MatMulGGUF's and kiln.MoE's GGUF experts' layout "records" of those ggml types,
#     kiln/gguf_records.py); `gguf` engines of files with Q5_K or Q8_0 matrices and int8-weight-only MoE engines hold
#     them.
# 15: kiln.MatMulQ4_1's centre attribute, and kiln.MoE's for Q4_1 experts (kiln/matmul_q4_1.py); `gguf` engines of
#     files with Q4_0 matrices (run as Q4_1 records, centred at 8) hold it.
OP_LIBRARY_ABI = 15
# The oldest engine ABI this library still runs: ABIs 2 to 15 only added optional inputs, attributes, a pool dtype,
# new ops and record types, so ABI-1 to ABI-13 graphs (RoPE as graph ops, no SwiGLU, Q4_1 blocks) are unchanged and
# need no rebuild.
OP_LIBRARY_MIN_ABI = 1
# The ABIs that added kiln.MoE's records, kiln.MatMulGGUF's, kiln.PagedAttention's q/k norms, more record types and
# the Q4_1 centre: a built engine records the newest its graphs need, and MOE_RECORDS_ABI - 1 when they need none of
# them, so older kilns still load the engines that need nothing newer (`engine_abi`).
MOE_RECORDS_ABI = 11
GGUF_RECORDS_ABI = 12
QK_NORM_ABI = 13
MORE_RECORDS_ABI = 14
CENTRE_ABI = 15


# What a built graph may need of the op library beyond MOE_RECORDS_ABI - 1, by the ABI that first ran it: kiln.MoE
# records, kiln.MatMulGGUF records, kiln.PagedAttention's q_norm / k_norm inputs, Q5_K or Q8_0 records, a centre
# attribute on Q4_1 weights.
ENGINE_NEEDS: dict[str, int] = {
    "moe_records": MOE_RECORDS_ABI,
    "gguf_records": GGUF_RECORDS_ABI,
    "qk_norms": QK_NORM_ABI,
    "newer_records": MORE_RECORDS_ABI,
    "q4_1_centres": CENTRE_ABI,
}


def engine_abi(needs: Iterable[str]) -> int:
    """The op-library ABI a built engine records: the lowest whose library runs its graphs, as far as the build tells
    them apart (``needs``: keys of ENGINE_NEEDS; every ABI up to MOE_RECORDS_ABI - 1 is assumed)."""
    needs = set(needs)
    unknown = needs - ENGINE_NEEDS.keys()
    if unknown:
        raise KeyError(f"no op-library ABI is known for {sorted(unknown)}; add it to ENGINE_NEEDS")
    return max((ENGINE_NEEDS[need] for need in needs), default=MOE_RECORDS_ABI - 1)


INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
QUERY_START_LOC = "query_start_loc"
SEQ_LENS = "seq_lens"
BLOCK_TABLES = "block_tables"
LOGITS_INDICES = "logits_indices"
LOGITS = "logits"
MEDUSA_INDICES = "medusa_indices"
MEDUSA_LOGITS = "medusa_logits"
MEDUSA_HIDDEN = "medusa_hidden"
# kiln.PagedAttention's optional 11th input, a graph input of Gemma 3 vision-language engines (kiln/paged_attention.py)
ATTEND_UNTIL = "attend_until"


def kv_cache_input(layer: int) -> str:
    return f"kv_cache.{layer}"


def kv_cache_output(layer: int) -> str:
    return f"kv_cache_out.{layer}"


# KV pool element types by the name the build options and the manifest use. An int8 pool's
# per-head steps are graph initializers (kv_scale.{i}), so the pool itself stays one plain tensor.
KV_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "int8": np.dtype(np.int8),
}


@dataclass(frozen=True)
class KvPoolSpec:
    """The KV pools of an engine graph, all but their number of blocks (which the runtime chooses)."""

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    kv_dtype: str  # a key of KV_DTYPES

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "block_size", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KV pool {name} must be a positive integer, got {value!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype {self.kv_dtype!r} is not one of {list(KV_DTYPES)}")

    @property
    def dtype(self) -> np.dtype:
        return KV_DTYPES[self.kv_dtype]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers' pools (K and V)."""
        return self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim * self.dtype.itemsize

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's pool: [num_blocks, 2 (K, V), num_kv_heads, block_size, head_dim]."""
        return (num_blocks, 2, self.num_kv_heads, self.block_size, self.head_dim)
