// kiln.PagedAttention (domain "kiln", version 1): the ONNX Runtime CPU kernel.
//
// The contract (inputs, outputs, attributes, semantics) is written once, with its numpy
// reference implementation, in kiln/paged_attention.py; this file implements it.
//
//   1. validate every input against the others (no out-of-bounds read on bad input);
//   2. if kv_cache_out is not the same buffer as kv_cache, copy the pool (slow fallback);
//   3. write the new tokens' K/V into their slots of kv_cache_out (K rotated first when cos/sin
//      are given; int8 pools: quantized with the per-KV-head steps of kv_scale [2, Hkv]);
//   4. attention: work items (sequence, kv head, chunk of query tokens, context partition)
//      run on ONNX Runtime's intra-op thread pool; each streams the (block, head) K/V
//      tiles once for all query heads of its group (queries rotated as they are loaded), with a
//      flash-style online softmax;
//   5. items that split one long context (decode with few sequences) are merged.
//
// Built with -O3 -mavx2 -mfma -mf16c; RegisterCustomOps refuses to load without AVX2.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "matmul_gguf.h"
#include "matmul_q4_1.h"
#include "moe.h"
#include "parallel_for.h"
#include "rescore_logits.h"
#include "swiglu.h"
#include "simd.h"
#include "validate.h"

namespace kiln {

constexpr int kAbiVersion = 6;  // kiln.contract.OP_LIBRARY_ABI
constexpr int kTargetRowsPerItem = 64;  // query rows (tokens x heads of one group) per work item
constexpr int kMinPartition = 128;      // smallest context partition worth a separate item
// Attention work (query rows x keys x head_dim) below which the calling thread runs every item:
// waking ORT's pool costs more than it saves (measured break-even, SmolLM2 shapes: one ~120-token
// decode; on a busy machine the pool's wait is far longer).
constexpr int64_t kSerialWork = 1024 * 64;
// Tiles are prefetched this many blocks ahead: a (block, head) tile is a few KB at a random place
// in the pool, which the hardware prefetchers cannot anticipate (16 x 2048 decode: 4.8 -> 1.6 ms).
constexpr int kPrefetchBlocks = 2;

struct WorkItem {
  int32_t seq, kv_head, q_begin, q_end;  // query tokens [q_begin, q_end) of the sequence
  int32_t ctx_begin, ctx_end;            // key positions [ctx_begin, ctx_end)
  int64_t partial;                       // first partial row, or -1: write `out` directly
  int64_t cost;
};

struct SplitGroup {  // one (sequence, kv head, query chunk) whose context was partitioned
  int32_t seq, kv_head, q_begin, q_end, num_parts;
  int64_t partial;
};

// Everything a work item reads; built once per Compute call after validation.
template <typename KvT>
struct Problem {
  const float* q;  // token t's query head h at q + t * q_stride + h * D
  const float* k;  // token t's KV head g at k + t * kv_stride + g * D (v likewise)
  const float* v;
  int64_t q_stride, kv_stride;  // packed QKV: both (H + 2 Hkv) D; else H D and Hkv D
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* qsl;
  KvT* pool;
  float* out;
  float* partials;  // rows of [m, l, acc[D]]
  const float* kv_scale;  // int8 pools: [2, Hkv] (row 0 K, row 1 V); nullptr for float pools
  const float* cos;       // RoPE inside the op: [P, rot_half] each; nullptr when Q/K arrive rotated
  const float* sin;
  int64_t rot_half;
  bool interleaved;
  int64_t num_tokens, H, Hkv, D, G, block_size, max_blocks;
  float scale;
  float softcap;  // > 0: scores -> softcap * tanh(scores / softcap) (Gemma 2)
  int64_t window;

  int64_t first_pos(int32_t s) const { return seq_lens[s] - (qsl[s + 1] - qsl[s]); }
  // Quantization step of K (kv = 0) or V (kv = 1) of a KV head; 1 for float pools.
  float step(int kv, int64_t kv_head) const { return kv_scale ? kv_scale[kv * Hkv + kv_head] : 1.f; }
  // dst [D] = src rotated at absolute position pos (a copy without cos/sin).
  void rotate(float* dst, const float* src, int64_t pos) const {
    if (cos == nullptr) return (void)std::memcpy(dst, src, D * sizeof(float));
    rotate_row(dst, src, cos + pos * rot_half, sin + pos * rot_half, rot_half, D, interleaved);
  }
  KvT* tile(int32_t s, int64_t logical_block, int kv, int32_t kv_head) const {
    const int64_t phys = block_tables[s * max_blocks + logical_block];
    return pool + ((phys * 2 + kv) * Hkv + kv_head) * block_size * D;
  }
};

// ---------------------------------------------------------------- write new K/V

template <typename KvT>
void write_token(const Problem<KvT>& p, int32_t s, int64_t t) {
  const int64_t pos = p.first_pos(s) + (t - p.qsl[s]);
  const int64_t slot = pos % p.block_size;
  thread_local std::vector<float> rotated;
  if (p.cos != nullptr && rotated.size() < static_cast<size_t>(p.D)) rotated.resize(p.D);
  for (int32_t g = 0; g < p.Hkv; ++g) {
    const float* k = p.k + t * p.kv_stride + g * p.D;
    if (p.cos != nullptr) p.rotate(rotated.data(), k, pos), k = rotated.data();
    store_row(p.tile(s, pos / p.block_size, 0, g) + slot * p.D, k, p.D, p.step(0, g));
    store_row(p.tile(s, pos / p.block_size, 1, g) + slot * p.D, p.v + t * p.kv_stride + g * p.D, p.D, p.step(1, g));
  }
}

// ---------------------------------------------------------------- attention

// s[j] = cap * tanh(s[j] / cap): Gemma 2's attention logit soft-cap, on the scaled scores before the softmax.
// tanh(|y|) = (1 - e) / (1 + e) with e = exp(-2|y|) <= 1 (exp256's domain), the sign put back: absolute error
// ~1e-7 of the cap, against 8 std::tanh calls per vector (a scalar loop cost decode ~8% at head_dim 256).
inline void soft_cap(float* s, int n, float cap) {
  const __m256 vcap = _mm256_set1_ps(cap), minus_two = _mm256_set1_ps(-2.f), one = _mm256_set1_ps(1.f);
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 y = _mm256_div_ps(_mm256_loadu_ps(s + j), vcap);  // divided, as transformers computes it
    const __m256 e = exp256(_mm256_mul_ps(minus_two, _mm256_andnot_ps(sign_bit, y)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    _mm256_storeu_ps(s + j, _mm256_mul_ps(vcap, _mm256_or_ps(t, _mm256_and_ps(y, sign_bit))));
  }
  for (; j < n; ++j) s[j] = cap * std::tanh(s[j] / cap);
}

struct RowState {
  float* q;    // [D], pre-scaled
  float* acc;  // [D]
  float m, l;  // running max and softmax denominator
};

struct ActiveRow {
  int row, lo, hi;  // keys [lo, hi) of the current block slice
};

constexpr int kGroup = 4;  // most rows sharing each K and V load

// Up to kGroup rows against one block slice K/V (float, row stride D): scores over the union of
// their key ranges, each row masked to its own range, online softmax, then one blocked P.V.
inline void attend_group(RowState* st, const ActiveRow* act, int nr, const float* K, const float* V, int64_t D,
                         float* sbuf, int ld, float softcap, const Prefetch& next_k, const Prefetch& next_v) {
  int a = act[0].lo, b = act[0].hi;
  for (int r = 1; r < nr; ++r) a = std::min(a, act[r].lo), b = std::max(b, act[r].hi);
  const int n = b - a;
  const float* qs[kGroup];
  float* ss[kGroup];
  float* accs[kGroup];
  for (int r = 0; r < nr; ++r) qs[r] = st[act[r].row].q, ss[r] = sbuf + r * ld, accs[r] = st[act[r].row].acc;
  switch (nr) {
    case 1: dot_rows<1>(qs, K + a * D, n, D, ss, next_k); break;
    case 2: dot_rows<2>(qs, K + a * D, n, D, ss, next_k); break;
    case 3: dot_rows<3>(qs, K + a * D, n, D, ss, next_k); break;
    default: dot_rows<2>(qs, K + a * D, n, D, ss, next_k), dot_rows<2>(qs + 2, K + a * D, n, D, ss + 2, Prefetch{}); break;
  }
  for (int r = 0; r < nr; ++r) {
    RowState& row = st[act[r].row];
    float* s = ss[r];
    const int lo = act[r].lo - a, hi = act[r].hi - a;
    if (softcap > 0.f) soft_cap(s + lo, hi - lo, softcap);
    const float mx = max_of(s + lo, hi - lo);
    if (mx > row.m) {
      if (row.l > 0.f) {
        const float corr = std::exp(row.m - mx);
        row.l *= corr;
        scale_row(row.acc, corr, D);
      }
      row.m = mx;
    }
    row.l += exp_shift_sum(s + lo, hi - lo, row.m);
    if (lo > 0) std::fill(s, s + lo, 0.f);
    if (hi < n) std::fill(s + hi, s + n, 0.f);
  }
  const float* const* ps = ss;
  switch (nr) {
    case 1: accumulate_rows<1>(accs, ps, V + a * D, n, D, next_v); break;
    case 2: accumulate_rows<2>(accs, ps, V + a * D, n, D, next_v); break;
    case 3: accumulate_rows<3>(accs, ps, V + a * D, n, D, next_v); break;
    default: accumulate_rows<4>(accs, ps, V + a * D, n, D, next_v); break;
  }
}

// The tile `ahead` blocks past block blk of item w, read on: past w's last block, the next item's first ones
// (`next`, or nullptr). A decode item spans a few blocks, so without the next item's tiles its first
// kPrefetchBlocks would always be demand misses: a step's other layers have evicted the pool by now.
template <typename KvT>
const KvT* tile_ahead(const Problem<KvT>& p, const WorkItem& w, const WorkItem* next, int64_t blk, int kv) {
  const int64_t bs = p.block_size, ahead = blk + kPrefetchBlocks;
  if (ahead * bs < w.ctx_end) return p.tile(w.seq, ahead, kv, w.kv_head);
  if (next == nullptr) return nullptr;
  const int64_t past = ahead - (w.ctx_end + bs - 1) / bs;  // blocks beyond w's last: 0, 1, ...
  const int64_t nblk = next->ctx_begin / bs + past;
  return nblk * bs < next->ctx_end ? p.tile(next->seq, nblk, kv, next->kv_head) : nullptr;
}

template <typename KvT>
void run_item(const Problem<KvT>& p, const WorkItem& w, const WorkItem* next) {
  const int64_t D = p.D, G = p.G, bs = p.block_size;
  const int nq = w.q_end - w.q_begin;
  const int rows = nq * static_cast<int>(G);
  thread_local std::vector<float> scratch;
  const size_t need = static_cast<size_t>(rows) * (2 * D) + kGroup * bs + (std::is_same<KvT, float>::value ? 0 : 2 * bs * D);
  if (scratch.size() < need) scratch.resize(need);
  float* qbuf = scratch.data();
  float* accbuf = qbuf + rows * D;
  float* scores = accbuf + rows * D;
  float* kbuf = scores + kGroup * bs;
  float* vbuf = kbuf + bs * D;

  const int64_t first = p.first_pos(w.seq);
  const int64_t tok0 = p.qsl[w.seq];
  // int8 pools: scores = scale * k_step * (q . k_i8), out = v_step * sum p_j v_i8_j; both steps
  // factor out of the inner loops (k_step into the pre-scaled q, v_step into the final rows).
  const float q_scale = p.scale * p.step(0, w.kv_head), v_step = p.step(1, w.kv_head);
  std::vector<RowState> st(rows);
  std::vector<ActiveRow> act(rows);
  // Rows of one token share their key range: groups of 3 keep G=3 (SmolLM2) groups unmasked.
  const int group = (G % 3 == 0 && G % 4 != 0) ? 3 : kGroup;
  for (int i = 0; i < nq; ++i) {
    for (int64_t hh = 0; hh < G; ++hh) {
      const int r = i * static_cast<int>(G) + static_cast<int>(hh);
      const int64_t h = w.kv_head * G + hh;
      st[r] = RowState{qbuf + r * D, accbuf + r * D, -std::numeric_limits<float>::infinity(), 0.f};
      const float* q = p.q + (tok0 + w.q_begin + i) * p.q_stride + h * D;
      if (p.cos == nullptr) {
        scaled_copy(st[r].q, q, q_scale, D);
      } else {
        p.rotate(st[r].q, q, first + w.q_begin + i);
        scale_row(st[r].q, q_scale, D);
      }
      std::fill(st[r].acc, st[r].acc + D, 0.f);
    }
  }

  const int64_t tile_bytes = bs * D * static_cast<int64_t>(sizeof(KvT));
  for (int64_t blk = w.ctx_begin / bs; blk * bs < w.ctx_end; ++blk) {
    const int64_t base = blk * bs;
    const int j0 = static_cast<int>(std::max<int64_t>(w.ctx_begin, base) - base);
    const int j1 = static_cast<int>(std::min<int64_t>(w.ctx_end, base + bs) - base);
    int nact = 0;
    for (int i = 0; i < nq; ++i) {
      const int64_t pos = first + w.q_begin + i;
      int64_t lo = j0;
      if (p.window > 0) lo = std::max<int64_t>(lo, pos - p.window + 1 - base);
      const int64_t hi = std::min<int64_t>(j1, pos + 1 - base);
      if (lo >= hi) continue;
      for (int64_t hh = 0; hh < G; ++hh)
        act[nact++] = ActiveRow{static_cast<int>(i * G + hh), static_cast<int>(lo - j0), static_cast<int>(hi - j0)};
    }
    if (nact == 0) continue;
    const float* K = as_float(p.tile(w.seq, blk, 0, w.kv_head) + j0 * D, kbuf, (j1 - j0) * D);
    const float* V = as_float(p.tile(w.seq, blk, 1, w.kv_head) + j0 * D, vbuf, (j1 - j0) * D);
    Prefetch next_k, next_v;  // the tiles kPrefetchBlocks ahead, fetched during this block's math
    if (const KvT* t = tile_ahead(p, w, next, blk, 0)) next_k = Prefetch{reinterpret_cast<const char*>(t), tile_bytes};
    if (const KvT* t = tile_ahead(p, w, next, blk, 1)) next_v = Prefetch{reinterpret_cast<const char*>(t), tile_bytes};
    for (int g = 0; g < nact; g += group)
      attend_group(st.data(), act.data() + g, std::min(group, nact - g), K, V, D, scores, static_cast<int>(bs), p.softcap,
                   g == 0 ? next_k : Prefetch{}, g == 0 ? next_v : Prefetch{});
  }

  for (int i = 0; i < nq; ++i) {
    for (int64_t hh = 0; hh < G; ++hh) {
      const RowState& r = st[i * G + hh];
      if (w.partial < 0) {
        float* o = p.out + ((tok0 + w.q_begin + i) * p.H + w.kv_head * G + hh) * D;
        const float inv = r.l > 0.f ? v_step / r.l : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] = r.acc[d] * inv;
      } else {
        float* pr = p.partials + (w.partial + i * G + hh) * (D + 2);
        pr[0] = r.m;
        pr[1] = r.l;
        for (int64_t d = 0; d < D; ++d) pr[2 + d] = r.acc[d] * v_step;
      }
    }
  }
}

template <typename KvT>
void merge_group(const Problem<KvT>& p, const SplitGroup& g) {
  const int64_t D = p.D, G = p.G;
  const int rows = (g.q_end - g.q_begin) * static_cast<int>(G);
  for (int r = 0; r < rows; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int part = 0; part < g.num_parts; ++part) m = std::max(m, p.partials[(g.partial + part * rows + r) * (D + 2)]);
    const int i = r / static_cast<int>(G), hh = r % static_cast<int>(G);
    float* o = p.out + ((p.qsl[g.seq] + g.q_begin + i) * p.H + g.kv_head * G + hh) * D;
    std::fill(o, o + D, 0.f);
    float l = 0.f;
    for (int part = 0; part < g.num_parts; ++part) {
      const float* pr = p.partials + (g.partial + part * rows + r) * (D + 2);
      if (pr[1] <= 0.f) continue;
      const float w = std::exp(pr[0] - m);
      l += w * pr[1];
      for (int64_t d = 0; d < D; ++d) o[d] += w * pr[2 + d];
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

// ---------------------------------------------------------------- planning

// Query rows x keys x head_dim of the whole batch (an upper bound: causal masking not counted).
template <typename KvT>
int64_t attention_work(const Problem<KvT>& p, int64_t num_seqs) {
  int64_t work = 0;
  for (int32_t s = 0; s < num_seqs; ++s) {
    const int64_t keys = p.window > 0 ? std::min<int64_t>(p.seq_lens[s], p.window) : p.seq_lens[s];
    work += static_cast<int64_t>(p.qsl[s + 1] - p.qsl[s]) * p.H * keys * p.D;
  }
  return work;
}

// Splits the batch into work items. Long contexts are partitioned (flash-decoding) only
// when there are too few items to keep every thread busy, and never for `serial` work.
template <typename KvT>
int64_t plan(const Problem<KvT>& p, int64_t num_seqs, bool serial, std::vector<WorkItem>& items,
             std::vector<SplitGroup>& groups) {
  const int32_t qc = static_cast<int32_t>(std::max<int64_t>(1, kTargetRowsPerItem / p.G));
  struct Chunk { int32_t seq, q_begin, q_end; int64_t lo, hi; };
  std::vector<Chunk> chunks;
  for (int32_t s = 0; s < num_seqs; ++s) {
    const int32_t q_len = p.qsl[s + 1] - p.qsl[s];
    for (int32_t b = 0; b < q_len; b += qc) {
      const int32_t e = std::min(q_len, b + qc);
      const int64_t hi = p.first_pos(s) + e;
      const int64_t lo = p.window > 0 ? std::max<int64_t>(0, p.first_pos(s) + b - p.window + 1) : 0;
      chunks.push_back({s, b, e, lo, hi});
    }
  }
  const int64_t base_items = static_cast<int64_t>(chunks.size()) * p.Hkv;
  static const int64_t threads = std::max(1u, std::thread::hardware_concurrency());  // reads /sys: once
  const int64_t target = 8 * threads;
  const int64_t max_split = serial || base_items >= target ? 1 : (target + base_items - 1) / base_items;
  int64_t partial_rows = 0;
  for (const Chunk& c : chunks) {
    const int64_t n = c.hi - c.lo;
    const int rows = (c.q_end - c.q_begin) * static_cast<int>(p.G);
    int64_t parts = std::min<int64_t>(max_split, n / kMinPartition);
    int64_t part_len = n;
    if (parts > 1) {
      part_len = ((n + parts - 1) / parts + p.block_size - 1) / p.block_size * p.block_size;
      parts = (n + part_len - 1) / part_len;
    }
    for (int32_t g = 0; g < p.Hkv; ++g) {
      if (parts <= 1) {
        items.push_back({c.seq, g, c.q_begin, c.q_end, (int32_t)c.lo, (int32_t)c.hi, -1, rows * n});
        continue;
      }
      groups.push_back({c.seq, g, c.q_begin, c.q_end, (int32_t)parts, partial_rows});
      for (int64_t part = 0; part < parts; ++part) {
        const int64_t b = c.lo + part * part_len, e = std::min(c.hi, b + part_len);
        items.push_back({c.seq, g, c.q_begin, c.q_end, (int32_t)b, (int32_t)e, partial_rows, rows * (e - b)});
        partial_rows += rows;
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return partial_rows;
}

// ---------------------------------------------------------------- the op

struct Rotary {  // the optional 9th and 10th inputs; both nullptr when Q/K arrive rotated
  const Ort::Custom::Tensor<float>* cos;
  const Ort::Custom::Tensor<float>* sin;
};

template <typename KvT>
struct PagedAttention {
  PagedAttention(const OrtApi*, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    num_heads_ = ki.GetAttribute<int64_t>("num_heads");
    num_kv_heads_ = ki.GetAttribute<int64_t>("num_kv_heads");
    try { scale_ = ki.GetAttribute<float>("scale"); } catch (const Ort::Exception&) { scale_ = 0.f; }
    try { window_ = ki.GetAttribute<int64_t>("sliding_window"); } catch (const Ort::Exception&) { window_ = 0; }
    try { softcap_ = ki.GetAttribute<float>("softcap"); } catch (const Ort::Exception&) { softcap_ = 0.f; }
    try {
      interleaved_ = ki.GetAttribute<int64_t>("rotary_interleaved");
    } catch (const Ort::Exception&) {
      interleaved_ = 0;
    }
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& query, const Ort::Custom::Tensor<float>& key,
                      const Ort::Custom::Tensor<float>& value, const Ort::Custom::Tensor<KvT>& kv_cache,
                      const Ort::Custom::Tensor<int32_t>& block_tables, const Ort::Custom::Tensor<int32_t>& seq_lens,
                      const Ort::Custom::Tensor<int32_t>& query_start_loc,
                      std::optional<const Ort::Custom::Tensor<float>*> kv_scale,
                      std::optional<const Ort::Custom::Tensor<float>*> cos_cache,
                      std::optional<const Ort::Custom::Tensor<float>*> sin_cache, Ort::Custom::Tensor<float>& out,
                      Ort::Custom::Tensor<KvT>& kv_cache_out) {
    try {
      const Rotary rotary{cos_cache.value_or(nullptr), sin_cache.value_or(nullptr)};
      run(ctx, query, key, value, kv_cache, block_tables, seq_lens, query_start_loc, kv_scale.value_or(nullptr), rotary,
          out, kv_cache_out);
    } catch (const Ort::Exception& e) {
      return Ort::Status(e.what(), e.GetOrtErrorCode());
    } catch (const std::exception& e) {
      return Ort::Status((std::string("kiln.PagedAttention: ") + e.what()).c_str(), ORT_FAIL);
    }
    return Ort::Status{nullptr};
  }

  void run(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& query, const Ort::Custom::Tensor<float>& key,
           const Ort::Custom::Tensor<float>& value, const Ort::Custom::Tensor<KvT>& kv_cache,
           const Ort::Custom::Tensor<int32_t>& block_tables, const Ort::Custom::Tensor<int32_t>& seq_lens,
           const Ort::Custom::Tensor<int32_t>& query_start_loc, const Ort::Custom::Tensor<float>* kv_scale,
           const Rotary& rotary, Ort::Custom::Tensor<float>& out, Ort::Custom::Tensor<KvT>& kv_cache_out) const {
    if (window_ < 0) fail("sliding_window must be >= 0");
    if (!(softcap_ >= 0.f) || std::isinf(softcap_)) fail("softcap must be finite and >= 0 (0 = off)");
    if (interleaved_ != 0 && interleaved_ != 1) fail("rotary_interleaved must be 0 (rotate_half) or 1 (adjacent pairs)");
    if ((rotary.cos == nullptr) != (rotary.sin == nullptr)) fail("cos_cache and sin_cache come together (RoPE needs both)");
    const auto& pool_shape = kv_cache.Shape();
    const QkvLayout qkv = validate_qkv(query.Shape(), key.Shape(), value.Shape(), num_heads_, num_kv_heads_);
    validate(pool_shape, block_tables.Shape(), seq_lens.Shape(), query_start_loc.Shape(), num_kv_heads_, qkv.head_dim);
    const int64_t T = qkv.num_tokens, S = block_tables.Shape()[0], max_blocks = block_tables.Shape()[1];
    const int64_t D = qkv.head_dim, bs = pool_shape[3];
    validate_values(block_tables.Data(), seq_lens.Data(), query_start_loc.Data(), S, max_blocks, T, pool_shape[0], bs, window_);
    const float* steps = nullptr;
    if (kv_scale != nullptr && kv_scale->Shape().size() == 1 && kv_scale->Shape()[0] == 0)
      kv_scale = nullptr;  // an empty tensor stands for an absent optional input
    if (is_int8<KvT>()) {
      if (kv_scale == nullptr)
        fail("an int8 kv_cache needs the 8th input kv_scale float32 [2, num_kv_heads=" + std::to_string(num_kv_heads_) +
             "] (row 0 K steps, row 1 V steps)");
      validate_kv_scale(kv_scale->Shape(), kv_scale->Data(), num_kv_heads_);
      steps = kv_scale->Data();
    } else if (kv_scale != nullptr) {
      fail("kv_scale is only for an int8 kv_cache; this kv_cache is " + std::string(is_f16<KvT>() ? "float16" : "float32"));
    }

    Problem<KvT> p{};
    p.q = query.Data();
    if (qkv.packed) {  // one row per token: its H query heads, then Hkv key heads, then Hkv value heads
      p.k = p.q + num_heads_ * D;
      p.v = p.k + num_kv_heads_ * D;
      p.q_stride = p.kv_stride = (num_heads_ + 2 * num_kv_heads_) * D;
    } else {
      p.k = key.Data();
      p.v = value.Data();
      p.q_stride = num_heads_ * D;
      p.kv_stride = num_kv_heads_ * D;
    }
    p.block_tables = block_tables.Data();
    p.seq_lens = seq_lens.Data();
    p.qsl = query_start_loc.Data();
    p.num_tokens = T;
    p.H = num_heads_;
    p.Hkv = num_kv_heads_;
    p.D = D;
    p.G = num_heads_ / num_kv_heads_;
    p.block_size = bs;
    p.max_blocks = max_blocks;
    p.scale = scale_ > 0.f ? scale_ : 1.f / std::sqrt(static_cast<float>(D));
    p.window = window_;
    p.softcap = softcap_;
    p.kv_scale = steps;
    if (rotary.cos != nullptr) {
      validate_rotary(rotary.cos->Shape(), rotary.sin->Shape(), D, p.seq_lens, p.qsl, S);
      p.cos = rotary.cos->Data();
      p.sin = rotary.sin->Data();
      p.rot_half = rotary.cos->Shape()[1];
      p.interleaved = interleaved_ == 1;
    }
    p.out = qkv.batch_of_one ? out.Allocate({1, T, num_heads_ * D}) : out.Allocate({T, num_heads_ * D});
    p.pool = kv_cache_out.Allocate(pool_shape);
    if (static_cast<const void*>(p.pool) != static_cast<const void*>(kv_cache.Data()))
      std::memcpy(p.pool, kv_cache.Data(), kv_cache.SizeInBytes());  // not aliased: correct but O(pool)
    if (T == 0) return;

    std::vector<int32_t> token_seq(T);
    for (int64_t s = 0; s < S; ++s)
      for (int32_t t = p.qsl[s]; t < p.qsl[s + 1]; ++t) token_seq[t] = static_cast<int32_t>(s);
    auto write = [&](size_t t) { write_token(p, token_seq[t], static_cast<int64_t>(t)); };
    if (T * p.Hkv * D >= 65536) parallel_for(ctx, T, write);
    else for (int64_t t = 0; t < T; ++t) write(t);

    const bool serial = attention_work(p, S) < kSerialWork;
    std::vector<WorkItem> items;
    std::vector<SplitGroup> groups;
    std::vector<float> partials(static_cast<size_t>(plan(p, S, serial, items, groups) * (D + 2)));
    p.partials = partials.data();
    // ORT's pool hands a thread the items in order (from its own shard): the next item is most often its next
    auto attend = [&](size_t i) { run_item(p, items[i], i + 1 < items.size() ? &items[i + 1] : nullptr); };
    if (serial) for (size_t i = 0; i < items.size(); ++i) attend(i);
    else parallel_for(ctx, items.size(), attend);
    auto merge = [&](size_t i) { merge_group(p, groups[i]); };
    if (partials.size() >= 65536) parallel_for(ctx, groups.size(), merge);
    else for (size_t i = 0; i < groups.size(); ++i) merge(i);  // cheaper than waking the pool
  }

  int64_t num_heads_ = 0, num_kv_heads_ = 0, window_ = 0, interleaved_ = 0;
  float scale_ = 0.f, softcap_ = 0.f;
};

}  // namespace kiln

extern "C" {

__attribute__((visibility("default"))) int kiln_ops_abi_version() { return kiln::kAbiVersion; }

// The instruction set this copy of the library was compiled for (build_ops.VARIANTS).
__attribute__((visibility("default"))) const char* kiln_ops_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512vnni";
#else
  return "avx2";
#endif
}

__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                                 const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    const std::string msg = std::string("libkiln_ops was built against ONNX Runtime API version ") +
                            std::to_string(ORT_API_VERSION) + ", newer than this onnxruntime (" +
                            api_base->GetVersionString() + "); upgrade onnxruntime";
    return api_base->GetApi(1)->CreateStatus(ORT_FAIL, msg.c_str());
  }
  Ort::InitApi(api);
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
    return api->CreateStatus(ORT_FAIL, "libkiln_ops needs a CPU with AVX2, FMA and F16C");
  static std::mutex mu;
  static Ort::CustomOpDomain* domain = nullptr;  // deliberately never freed: sessions keep pointers into it
  try {
    std::lock_guard<std::mutex> lock(mu);
    if (domain == nullptr) {
      domain = new Ort::CustomOpDomain("kiln");
      domain->Add(Ort::Custom::CreateLiteCustomOp<kiln::PagedAttention<float>>("PagedAttention", "CPUExecutionProvider"));
      domain->Add(Ort::Custom::CreateLiteCustomOp<kiln::PagedAttention<Ort::Float16_t>>("PagedAttention", "CPUExecutionProvider"));
      domain->Add(Ort::Custom::CreateLiteCustomOp<kiln::PagedAttention<int8_t>>("PagedAttention", "CPUExecutionProvider"));
      kiln::add_matmul_q4_1(*domain);
      kiln::add_matmul_gguf(*domain);
      kiln::add_swiglu(*domain);
      kiln::add_moe(*domain);
      kiln::add_rescore_logits(*domain);
    }
    Ort::UnownedSessionOptions(options).Add(*domain);
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}

}  // extern "C"
