// The ONNX Runtime CPU kernel of kiln.PagedAttention, without the op's glue: the problem a Compute call
// validated, the K/V writes, the work items and their plan, and the attention of one work item.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <type_traits>
#include <vector>

#include "attention_rows.h"
#include "simd.h"

namespace kiln {
constexpr int kTargetRowsPerItem = 64;  // query rows (tokens x heads of one group) per work item
constexpr int kMinPartition = 128;      // smallest context partition worth a separate item
// Attention work (query rows x keys x head_dim) below which the calling thread runs every item:
// waking ORT's pool costs more than it saves (measured break-even, SmolLM2 shapes: one ~120-token
// decode; on a busy machine the pool's wait is far longer).
constexpr int64_t kSerialWork = 1024 * 64;
// Tiles are prefetched this many blocks ahead: a (block, head) tile is a few KB at a random place
// in the pool, which the hardware prefetchers cannot anticipate (16 x 2048 decode: 4.8 -> 1.6 ms).
constexpr int kPrefetchBlocks = 2;
// Whole blocks that every row of an item sees entirely (all of a decode's, a prefill chunk's past) are attended
// kTileBlocks at a time: q.k of the tile's blocks, one online-softmax update of each row over all their scores,
// then P.V. The per-row softmax bookkeeping (max, rescale, sum), the calls and the accumulator loads and stores
// of P.V are paid once per 64 positions instead of once per 16-position block. Their tiles are prefetched one
// tile ahead.
constexpr int kTileBlocks = kTileMax;

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
  const int32_t* until;  // [T]: the last position each token sees; nullptr: its own (causal)
  int64_t num_tokens, H, Hkv, D, G, block_size, max_blocks;
  float scale;
  float softcap;  // > 0: scores -> softcap * tanh(scores / softcap) (Gemma 2)
  int64_t window;

  int64_t first_pos(int32_t s) const { return seq_lens[s] - (qsl[s + 1] - qsl[s]); }
  // The last key position token i of sequence s (at position pos) attends to.
  int64_t last_visible(int32_t s, int64_t i, int64_t pos) const { return until ? until[qsl[s] + i] : pos; }
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

struct RowState {
  float* q;    // [D], pre-scaled
  float* acc;  // [D]
  float m, l;  // running max and softmax denominator
};

struct ActiveRow {
  int row, lo, hi;  // keys [lo, hi) of the current block slice
};

constexpr int kGroup = 4;  // most rows sharing each K and V load

// q.k (dot_rows) and P.V (accumulate_rows) of nr <= kGroup rows, dispatched to their row counts.
template <typename T>
inline void dot_group(int nr, const float* const* qs, const T* K, int n, int64_t D, float* const* ss, const Prefetch& pf) {
  switch (nr) {
    case 1: dot_rows<1, 4>(qs, K, n, D, ss, pf); break;
    case 2: dot_rows<2, 4>(qs, K, n, D, ss, pf); break;
    case 3: dot_rows<3, 4>(qs, K, n, D, ss, pf); break;
    default: dot_rows<4, 2>(qs, K, n, D, ss, pf); break;
  }
}

template <typename T>
inline void accumulate_group(int nr, float* const* accs, const float* const* ps, const T* V, int n, int64_t D,
                             const Prefetch& pf) {
  switch (nr) {
    case 1: accumulate_rows<1>(accs, ps, V, n, D, pf); break;
    case 2: accumulate_rows<2>(accs, ps, V, n, D, pf); break;
    case 3: accumulate_rows<3>(accs, ps, V, n, D, pf); break;
    default: accumulate_rows<4>(accs, ps, V, n, D, pf); break;
  }
}

// A row's running max raised to mx where that is larger, its accumulator and denominator rescaled to match.
inline void raise_max(RowState& row, float mx, int64_t D) {
  if (mx <= row.m) return;
  if (row.l > 0.f) {
    const float corr = std::exp(row.m - mx);
    row.l *= corr;
    scale_row(row.acc, corr, D);
  }
  row.m = mx;
}

// One row's online-softmax update with scores s[0, n) (soft-capped first when softcap > 0): the running max
// raised, s[j] = exp(s[j] - m), the denominator summed.
inline void softmax_update(RowState& row, float* s, int n, int64_t D, float softcap) {
  if (softcap > 0.f) soft_cap(s, n, softcap);
  raise_max(row, max_of(s, n), D);
  row.l += exp_shift_sum(s, n, row.m);
}

// Up to kGroup rows against one block slice K/V (float, row stride D): scores over the union of
// their key ranges, each row masked to its own range, online softmax, then one blocked P.V.
template <typename T>
inline void attend_group(RowState* st, const ActiveRow* act, int nr, const T* K, const T* V, int64_t D,
                         float* sbuf, int ld, float softcap, const Prefetch& next_k, const Prefetch& next_v) {
  int a = act[0].lo, b = act[0].hi;
  for (int r = 1; r < nr; ++r) a = std::min(a, act[r].lo), b = std::max(b, act[r].hi);
  const int n = b - a;
  const float* qs[kGroup];
  float* ss[kGroup];
  float* accs[kGroup];
  for (int r = 0; r < nr; ++r) qs[r] = st[act[r].row].q, ss[r] = sbuf + r * ld, accs[r] = st[act[r].row].acc;
  dot_group(nr, qs, K + a * D, n, D, ss, next_k);
  for (int r = 0; r < nr; ++r) {
    float* s = ss[r];
    const int lo = act[r].lo - a, hi = act[r].hi - a;
    softmax_update(st[act[r].row], s + lo, hi - lo, D, softcap);
    if (lo > 0) std::fill(s, s + lo, 0.f);
    if (hi < n) std::fill(s + hi, s + n, 0.f);
  }
  accumulate_group(nr, accs, ss, V + a * D, n, D, next_v);
}

// A tile's block that every row sees whole: its K and V rows, their count, and the tiles to prefetch meanwhile.
template <typename T>
struct TileBlock {
  const T* K;
  const T* V;
  int n;
  Prefetch next_k, next_v;
};

// Four rows (a G = 4 group, the most common) against a tile: attend_tile's steps on the interleaved scores
// s[4 j + r] (attention_rows.h), whose per-row max, exp and sum run on all four rows' lanes at once.
template <typename T>
inline void attend_tile4(RowState* st, const TileBlock<T>* tb, int nb, int64_t D, float* s, float softcap,
                         bool prefetch) {
  const float* qs[4] = {st[0].q, st[1].q, st[2].q, st[3].q};
  float* accs[4] = {st[0].acc, st[1].acc, st[2].acc, st[3].acc};
  int total = 0;
  for (int b = 0; b < nb; total += tb[b].n, ++b)
    dot_rows4(qs, tb[b].K, tb[b].n, D, s + 4 * total, prefetch ? tb[b].next_k : Prefetch{});
  if (softcap > 0.f) soft_cap(s, 4 * total, softcap);
  alignas(16) float mx[4], l[4];
  _mm_store_ps(mx, max_rows4(s, total));
  for (int r = 0; r < 4; ++r) raise_max(st[r], mx[r], D);
  _mm_store_ps(l, exp_shift_sum4(s, total, _mm_setr_ps(st[0].m, st[1].m, st[2].m, st[3].m)));
  for (int r = 0; r < 4; ++r) st[r].l += l[r];
  const T* Vs[kTileBlocks];
  int ns[kTileBlocks];
  Prefetch pfs[kTileBlocks];
  for (int b = 0; b < nb; ++b) Vs[b] = tb[b].V, ns[b] = tb[b].n, pfs[b] = prefetch ? tb[b].next_v : Prefetch{};
  accumulate_rows4(accs, s, Vs, ns, nb, D, pfs);
}

// Rows st[row0, row0 + nr) (nr <= kGroup) against nb <= kTileBlocks blocks seen whole by every row: q.k of
// each block into its columns of the rows' score buffers (row stride ld >= the tile's positions), one softmax
// update over the tile, then P.V block by block.
template <typename T>
inline void attend_tile(RowState* st, int row0, int nr, const TileBlock<T>* tb, int nb, int64_t D, float* sbuf,
                        int ld, float softcap, bool prefetch) {
  if (nr == 4) return attend_tile4(st + row0, tb, nb, D, sbuf, softcap, prefetch);
  const float* qs[kGroup] = {};
  float* ss[kGroup] = {};
  float* accs[kGroup] = {};
  for (int r = 0; r < nr; ++r) qs[r] = st[row0 + r].q, accs[r] = st[row0 + r].acc;
  int total = 0;
  for (int b = 0; b < nb; total += tb[b].n, ++b) {
    for (int r = 0; r < nr; ++r) ss[r] = sbuf + r * ld + total;
    dot_group(nr, qs, tb[b].K, tb[b].n, D, ss, prefetch ? tb[b].next_k : Prefetch{});
  }
  for (int r = 0; r < nr; ++r) softmax_update(st[row0 + r], sbuf + r * ld, total, D, softcap);
  total = 0;
  for (int b = 0; b < nb; total += tb[b].n, ++b) {
    for (int r = 0; r < nr; ++r) ss[r] = sbuf + r * ld + total;
    accumulate_group(nr, accs, ss, tb[b].V, tb[b].n, D, prefetch ? tb[b].next_v : Prefetch{});
  }
}

// The tile `distance` blocks past block blk of item w, read on: past w's last block, the next item's first ones
// (`next`, or nullptr). A decode item spans a few blocks, so without the next item's tiles its first
// kPrefetchBlocks would always be demand misses: a step's other layers have evicted the pool by now.
template <typename KvT>
const KvT* tile_ahead(const Problem<KvT>& p, const WorkItem& w, const WorkItem* next, int64_t blk, int kv,
                      int64_t distance = kPrefetchBlocks) {
  const int64_t bs = p.block_size, ahead = blk + distance;
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
  const size_t need = static_cast<size_t>(rows) * (2 * D) + kGroup * kTileBlocks * bs;
  if (scratch.size() < need) scratch.resize(need);
  float* qbuf = scratch.data();
  float* accbuf = qbuf + rows * D;
  float* scores = accbuf + rows * D;

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
  const int ld = kTileBlocks * static_cast<int>(bs);  // score row stride
  auto ahead = [&](int64_t blk, int kv, int64_t distance) {
    const KvT* t = tile_ahead(p, w, next, blk, kv, distance);
    return t ? Prefetch{reinterpret_cast<const char*>(t), tile_bytes} : Prefetch{};
  };
  TileBlock<KvT> tile[kTileBlocks];
  int pending = 0;  // blocks seen whole by every row, not attended yet
  auto flush = [&] {
    for (int g = 0; g < rows && pending > 0; g += group)
      attend_tile(st.data(), g, std::min(group, rows - g), tile, pending, D, scores, ld, p.softcap, g == 0);
    pending = 0;
  };
  for (int64_t blk = w.ctx_begin / bs; blk * bs < w.ctx_end; ++blk) {
    const int64_t base = blk * bs;
    const int j0 = static_cast<int>(std::max<int64_t>(w.ctx_begin, base) - base);
    const int j1 = static_cast<int>(std::min<int64_t>(w.ctx_end, base + bs) - base);
    int nact = 0;
    for (int i = 0; i < nq; ++i) {
      const int64_t pos = first + w.q_begin + i;
      int64_t lo = j0;
      if (p.window > 0) lo = std::max<int64_t>(lo, pos - p.window + 1 - base);
      const int64_t hi = std::min<int64_t>(j1, p.last_visible(w.seq, w.q_begin + i, pos) + 1 - base);
      if (lo >= hi) continue;
      for (int64_t hh = 0; hh < G; ++hh)
        act[nact++] = ActiveRow{static_cast<int>(i * G + hh), static_cast<int>(lo - j0), static_cast<int>(hi - j0)};
    }
    if (nact == 0) continue;
    const KvT* K = p.tile(w.seq, blk, 0, w.kv_head) + j0 * D;
    const KvT* V = p.tile(w.seq, blk, 1, w.kv_head) + j0 * D;
    bool whole = nact == rows;  // every row sees all of [j0, j1)
    for (int r = 0; whole && r < nact; ++r) whole = act[r].lo == 0 && act[r].hi == j1 - j0;
    if (whole) {
      tile[pending++] = TileBlock<KvT>{K, V, j1 - j0, ahead(blk, 0, kTileBlocks), ahead(blk, 1, kTileBlocks)};
      if (pending == kTileBlocks) flush();
      continue;
    }
    flush();
    // the tiles kPrefetchBlocks ahead, fetched during this block's math
    const Prefetch next_k = ahead(blk, 0, kPrefetchBlocks), next_v = ahead(blk, 1, kPrefetchBlocks);
    for (int g = 0; g < nact; g += group)
      attend_group(st.data(), act.data() + g, std::min(group, nact - g), K, V, D, scores, ld, p.softcap,
                   g == 0 ? next_k : Prefetch{}, g == 0 ? next_v : Prefetch{});
  }
  flush();

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
      int64_t hi = p.first_pos(s) + e;
      for (int32_t i = b; p.until != nullptr && i < e; ++i) hi = std::max<int64_t>(hi, p.until[p.qsl[s] + i] + 1);
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

}  // namespace kiln
