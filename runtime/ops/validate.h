// Input validation of kiln.PagedAttention: every inconsistency is an Ort::Exception naming
// the input and the values involved, raised before the kernel reads anything out of bounds.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "onnxruntime_cxx_api.h"
#include "shape_text.h"

namespace kiln {

[[noreturn]] inline void fail(const std::string& msg) {
  throw Ort::Exception("kiln.PagedAttention: " + msg, ORT_INVALID_ARGUMENT);
}

// How query, key and value arrive: separate [T, H*D], [T, Hkv*D], [T, Hkv*D], or packed (key and value empty
// [0], query [T, (H + 2 Hkv) * D]: the fused QKV projection's rows); either way with an optional leading 1
// (the graph's batch of one), which the output then keeps.
struct QkvLayout {
  int64_t num_tokens, head_dim;
  bool packed, batch_of_one;
};

inline QkvLayout validate_qkv(std::vector<int64_t> qs, std::vector<int64_t> ks, std::vector<int64_t> vs, int64_t H,
                              int64_t Hkv) {
  if (H <= 0 || Hkv <= 0 || H % Hkv != 0)
    fail("num_heads (" + std::to_string(H) + ") must be a positive multiple of num_kv_heads (" + std::to_string(Hkv) + ")");
  const auto empty = [](const std::vector<int64_t>& s) { return s.size() == 1 && s[0] == 0; };
  const bool packed = empty(ks) && empty(vs);
  if (empty(ks) != empty(vs))
    fail("key and value are both empty (query holds packed Q|K|V) or both present, got key " + shape_text(ks) +
         " and value " + shape_text(vs));
  const bool batch_of_one = qs.size() == 3;
  if (batch_of_one) {
    if (qs[0] != 1) fail("a rank-3 query must be [1, num_tokens, width] (the batch of one), got " + shape_text(qs));
    qs.erase(qs.begin());
    if (!packed) {
      if (ks.size() != 3 || ks[0] != 1 || vs.size() != 3 || vs[0] != 1)
        fail("with a rank-3 query, key and value must be [1, num_tokens, num_kv_heads*head_dim], got " +
             shape_text(ks) + " and " + shape_text(vs));
      ks.erase(ks.begin());
      vs.erase(vs.begin());
    }
  }
  const int64_t heads = packed ? H + 2 * Hkv : H;
  if (qs.size() != 2 || qs[1] % heads != 0 || qs[1] == 0)
    fail(std::string("query must be [num_tokens, ") + (packed ? "(num_heads+2*num_kv_heads)" : "num_heads") +
         "*head_dim], got " + shape_text(qs) + " with num_heads=" + std::to_string(H) +
         (packed ? ", num_kv_heads=" + std::to_string(Hkv) + " (packed Q|K|V)" : ""));
  const int64_t D = qs[1] / heads;
  if (!packed) {
    if (ks.size() != 2 || ks[0] != qs[0] || ks[1] != Hkv * D)
      fail("key must be [num_tokens, num_kv_heads*head_dim] = [" + std::to_string(qs[0]) + ", " +
           std::to_string(Hkv * D) + "], got " + shape_text(ks));
    if (vs != ks) fail("value must have the shape of key " + shape_text(ks) + ", got " + shape_text(vs));
  }
  return QkvLayout{qs[0], D, packed, batch_of_one};
}

// The pool and the batch description.
inline void validate(const std::vector<int64_t>& pool, const std::vector<int64_t>& bts, const std::vector<int64_t>& sls,
                     const std::vector<int64_t>& qsls, int64_t Hkv, int64_t D) {
  const auto& shape = shape_text;
  if (pool.size() != 5 || pool[1] != 2 || pool[2] != Hkv || pool[3] <= 0 || pool[4] != D)
    fail("kv_cache must be [num_blocks, 2, num_kv_heads=" + std::to_string(Hkv) + ", block_size, head_dim=" + std::to_string(D) + "], got " + shape(pool));
  if (bts.size() != 2) fail("block_tables must be [num_seqs, max_blocks], got " + shape(bts));
  if (sls.size() != 1 || sls[0] != bts[0]) fail("seq_lens must be [num_seqs=" + std::to_string(bts[0]) + "], got " + shape(sls));
  if (qsls.size() != 1 || qsls[0] != bts[0] + 1) fail("query_start_loc must be [num_seqs+1=" + std::to_string(bts[0] + 1) + "], got " + shape(qsls));
}

// kv_scale of an int8 pool: [2, Hkv] of positive finite steps.
inline void validate_kv_scale(const std::vector<int64_t>& shape, const float* data, int64_t Hkv) {
  if (shape.size() != 2 || shape[0] != 2 || shape[1] != Hkv)
    fail("kv_scale must be [2, num_kv_heads=" + std::to_string(Hkv) + "], got " + shape_text(shape));
  for (int64_t i = 0; i < 2 * Hkv; ++i)
    if (!(data[i] > 0.f) || data[i] == std::numeric_limits<float>::infinity())
      fail("kv_scale[" + std::to_string(i / Hkv) + "][" + std::to_string(i % Hkv) + "] = " + std::to_string(data[i]) +
           " must be positive and finite");
}

// Values: offsets, lengths, and every block id a token can read.
inline void validate_values(const int32_t* bt, const int32_t* sl, const int32_t* qsl, int64_t S, int64_t max_blocks,
                            int64_t num_tokens, int64_t num_blocks, int64_t bs, int64_t window) {
  if (qsl[0] != 0) fail("query_start_loc[0] must be 0, got " + std::to_string(qsl[0]));
  if (qsl[S] != num_tokens)
    fail("query_start_loc[-1] (" + std::to_string(qsl[S]) + ") must equal num_tokens (" + std::to_string(num_tokens) + ")");
  for (int64_t s = 0; s < S; ++s) {
    const std::string seq = "sequence " + std::to_string(s) + ": ";
    const int64_t q_len = static_cast<int64_t>(qsl[s + 1]) - qsl[s];
    if (q_len < 0) fail(seq + "query_start_loc must be non-decreasing");
    if (sl[s] < q_len)
      fail(seq + "seq_lens (" + std::to_string(sl[s]) + ") is smaller than its number of new tokens (" + std::to_string(q_len) + ")");
    if (sl[s] > max_blocks * bs)
      fail(seq + "seq_lens (" + std::to_string(sl[s]) + ") needs more blocks than block_tables has columns (" +
           std::to_string(max_blocks) + " x block_size " + std::to_string(bs) + ")");
    if (q_len == 0) continue;
    const int64_t first = sl[s] - q_len;
    const int64_t lo = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;
    for (int64_t b = lo / bs; b * bs < sl[s]; ++b) {
      const int32_t id = bt[s * max_blocks + b];
      if (id < 0 || id >= num_blocks)
        fail(seq + "block_tables[" + std::to_string(s) + "][" + std::to_string(b) + "] = " + std::to_string(id) +
             " is outside the pool of " + std::to_string(num_blocks) + " blocks");
    }
  }
}

// cos_cache/sin_cache: both [P, half] with 0 < 2 * half <= D, and every new token's position below P.
inline void validate_rotary(const std::vector<int64_t>& cos, const std::vector<int64_t>& sin, int64_t D,
                            const int32_t* sl, const int32_t* qsl, int64_t S) {
  const auto& shape = shape_text;
  if (cos.size() != 2 || cos != sin || cos[1] <= 0 || 2 * cos[1] > D)
    fail("cos_cache and sin_cache must both be [max_position, rotary_dim/2] with 0 < rotary_dim <= head_dim (" +
         std::to_string(D) + "), got " + shape(cos) + " and " + shape(sin));
  for (int64_t s = 0; s < S; ++s)
    if (qsl[s + 1] > qsl[s] && sl[s] > cos[0])
      fail("sequence " + std::to_string(s) + ": position " + std::to_string(sl[s] - 1) + " is past the cos/sin cache (" +
           std::to_string(cos[0]) + " positions; the engine's max_seq_len bounds it)");
}

// attend_until [T] int32: each token's last visible position, from its own to its sequence's last.
inline void validate_attend_until(const std::vector<int64_t>& shape, const int32_t* until, const int32_t* sl,
                                  const int32_t* qsl, int64_t S, int64_t T) {
  if (shape.size() != 1 || shape[0] != T)
    fail("attend_until must be int32 [num_tokens=" + std::to_string(T) + "] (or empty [0]: causal), got " +
         shape_text(shape));
  for (int64_t s = 0; s < S; ++s) {
    const int64_t first = sl[s] - (qsl[s + 1] - qsl[s]);
    for (int32_t t = qsl[s]; t < qsl[s + 1]; ++t)
      if (until[t] < first + (t - qsl[s]) || until[t] >= sl[s])
        fail("attend_until[" + std::to_string(t) + "] = " + std::to_string(until[t]) + " must be from the token's "
             "position (" + std::to_string(first + (t - qsl[s])) + ") to its sequence's last (" +
             std::to_string(sl[s] - 1) + ")");
  }
}

}  // namespace kiln
