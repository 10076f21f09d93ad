// kiln.MatMulGGUF, int8 activations (the attribute int8_activations = 1): the ONNX Runtime CPU kernel.
//
// The arithmetic is written once, as exact integers, in kiln/gguf_int8.py; this file implements it.
//
//   1. each activation row is quantized to int8 in blocks of the weight type's granularity (Q4_0, Q8_0: 32 values;
//      the k-quants: 256, llama.cpp's Q8_K), step max|x| / 127, with int sums per 16 values for Q6_K's offset of
//      32, and for Q4_K / Q5_K per sub-block of 32 the float sum S and what int8 loses of it, E = S - step sum(xq);
//   2. a tile is one output channel x up to kTileRows rows (Q4_0, Q8_0: 4; the k-quants: 8 up to K = 4096, 4
//      above, their unpacking and scale decoding shared by more rows); for each block, the block's integers are
//      unpacked to bytes once (32 a vector; a k-quant's scales broadcast by pshufb from one int16 vector) and
//      multiplied into each row's int8 with maddubs (unsigned weight byte x signed activation, pairs summed in
//      int16: at most 63 x 127 x 2, no saturation) and madd (the pairs times the sub-block's integer scale, summed
//      in int32). The integer block sum is exact; it meets float once per block:
//          acc += (step * d) * isum  [+ sum_j (c (d sc_j)) E_j - sum_j (dmin m_j) S_j   for Q4_K / Q5_K]
//      (the minimums from the exact float sums, and the codes' mean c (7.5, 15.5) from E: int8 rounding then
//      reaches only the centred codes, as in kiln.MatMulQ4_1). A many-row k-quant tile is bound by the core's two
//      vector-multiply pipes (maddubs, madd and the float FMAs share them): per (row, block) 16 integer multiplies
//      and 2-4 float ones, which no tile shape reduces while each row's 8 lanes keep their integer sums; so the
//      tile keeps each row's sums in registers as they accumulate (in_register) and nothing else of a block's
//      work moves to memory;
//   3. work items (16 channels x 32 rows) run on ONNX Runtime's intra-op thread pool (each thread a contiguous
//      shard of them, stealing at the end); a k-quant tile call takes its item's channels one after the other and
//      prefetches the weight stream a page ahead.
//
// The weights are the file's blocks as they are (no repacking). Each row's arithmetic is the same in every tile
// size, so a row's outputs are bitwise the same for every T and every thread count; only the float32 sums over
// blocks (8 lanes, then the lanes) differ in order from the spec's float64 sum. The AVX-512 VNNI library compiles
// the same code.
#define ORT_API_MANUAL_INIT
#include "matmul_gguf_int8.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "parallel_for.h"
#include "simd.h"

namespace kiln {

using gguf_int8::Int8Rows;
using gguf_int8::kSumGroup;
using gguf_int8::Layout;

namespace {

constexpr int kTileRows = 4;      // Q4_0 / Q8_0: a tile is one channel x up to 4 rows
constexpr int kKTileRows = 8;     // the k-quants: a tile is one channel x up to 8 rows
constexpr int64_t kKTileRowsMaxK = 4096;  // ... for K up to 4096; kTileRows above
constexpr int64_t kChannelsPerItem = 16;
constexpr int64_t kPrefetchAhead = 4096;  // bytes of the weight stream a k-quant tile prefetches ahead
constexpr int64_t kRowsPerItem = 32;
constexpr int64_t kParallelQuantize = 1 << 15;  // activation elements from which quantizing is parallel

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// unsigned bytes u x signed bytes s, pairs summed (int16), times the int16 multipliers m and pairs summed (int32)
inline __m256i dot_bytes(__m256i u, __m256i s, __m256i m) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), m); }

// ---- activations

// One row: per block, step = max|x| / 127 and q = rint(x * (1 / step)) (half to even), the spec's float32 numbers.
// sums (16-sums) and sub_sum / sub_error (per 32) are written where not nullptr.
void quantize_row(const float* x, int64_t K, int64_t block, int8_t* q, float* steps, int16_t* sums, float* sub_sum,
                  float* sub_error) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes packs' lane interleave
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t b = 0; b < K / block; ++b, x += block, q += block) {
    __m256 amax = _mm256_setzero_ps();
    for (int64_t i = 0; i < block; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    const float step = hmax(amax) / 127.f;
    const __m256 inv = _mm256_set1_ps(step > 0.f ? 1.f / step : 0.f);
    steps[b] = step;
    for (int64_t i = 0; i < block; i += 32) {
      __m256i v[4];
      for (int j = 0; j < 4; ++j)
        v[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), inv), kRound));
      if (sums != nullptr)  // 16 values: two vectors' lanes
        for (int h = 0; h < 2; ++h) {
          const __m256i s = _mm256_add_epi32(v[2 * h], v[2 * h + 1]);
          __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
          s4 = _mm_hadd_epi32(s4, s4);
          *sums++ = static_cast<int16_t>(_mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4)));
        }
      if (sub_sum != nullptr) {  // the float sum of the 32 values and its int8 part, summed in this order
        const __m256 v01 = _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i + 8));
        const __m256 v23 = _mm256_add_ps(_mm256_loadu_ps(x + i + 16), _mm256_loadu_ps(x + i + 24));
        const float S = hsum(_mm256_add_ps(v01, v23));
        const __m256i i4 = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(i4), _mm256_extracti128_si256(i4, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        const int isum = _mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4));
        *sub_sum++ = S;
        *sub_error++ = S - step * static_cast<float>(isum);
      }
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permutevar8x32_epi32(bytes, order));
    }
  }
}

// ---- the block types (layouts: kiln/gguf_blocks.py). block<NT>(b, rows, acc): rows.q[r] points at the block's
// first int8 activation of row r, rows.step[r] at its step, rows.sums[r] at its first 16-sum.

template <int NT>
struct RowPtrs {
  const int8_t* q[NT];
  const float* step[NT];
  const int16_t* sums[NT];      // Q6_K
  const float* sub_sum[NT];     // Q4_K / Q5_K
  const float* sub_error[NT];
};

// Q4_0 and Q8_0: signed weights w, so |w| (unsigned) times x with w's sign; |w| <= 128, the pairs fit int16.
template <int NT>
inline void signed_block(__m256i w, float d, const RowPtrs<NT>& rows, __m256* acc) {
  const __m256i ones = _mm256_set1_epi16(1), abs_w = _mm256_sign_epi8(w, w);
  for (int r = 0; r < NT; ++r) {
    const __m256i dot = dot_bytes(abs_w, _mm256_sign_epi8(load32(rows.q[r]), w), ones);
    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(rows.step[r][0] * d), _mm256_cvtepi32_ps(dot), acc[r]);
  }
}

struct Q4_0 {
  static constexpr int64_t kWeights = 32, kBytes = 18, kActBlock = 32;
  template <int NT>
  static void block(const uint8_t* b, const RowPtrs<NT>& rows, __m256* acc) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
    signed_block<NT>(_mm256_sub_epi8(nibbles, _mm256_set1_epi8(8)), f16(b), rows, acc);
  }
};

struct Q8_0 {
  static constexpr int64_t kWeights = 32, kBytes = 34, kActBlock = 32;
  template <int NT>
  static void block(const uint8_t* b, const RowPtrs<NT>& rows, __m256* acc) {
    signed_block<NT>(load32(b + 2), f16(b), rows, acc);
  }
};

// Q4_K / Q5_K's 6-bit scales and minimums (llama.cpp's get_scale_min_k4 on 32-bit words w0, w1, w2 of the 12 bytes)
// as the bytes sc[0..8) then mins[0..8) of one vector, in vector registers:
//   sc 0..3 = w0 & 0x3f   sc 4..7 = (w2 & 0x0f) | ((w0 >> 2) & 0x30)
//   m 0..3  = w1 & 0x3f   m 4..7  = ((w2 >> 4) & 0x0f) | ((w1 >> 2) & 0x30)
inline __m128i k_scales(const uint8_t* b) {
  const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));  // w0 w1 w2 and 4 bytes past them
  const __m128i low = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(w, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4)),
                                    _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i top = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(w, _MM_SHUFFLE(1, 1, 0, 0)), 2),
                                    _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  return _mm_or_si128(low, top);
}

// A k-quant block (Q4_K, Q5_K, Q6_K) decodes into group g's 32 weights (inputs 32g..32g + 31) as unsigned codes q_g
// and s_g, the int16 multipliers madd puts on maddubs' pairs: the sub-block scale (Q4_K / Q5_K: one a group; Q6_K:
// scale 2g on the low 128-bit lane, 2g + 1 on the high one). A row's integer block sum is then
// isum = sum_g madd(maddubs(q_g, xq_g), s_g) whatever the type; `decode(b, floats, f)` calls f(g, q_g, s_g) for
// g = 0..7 and fills the float terms that meet isum:
struct KFloats {
  __m256 centred, minimum;  // Q4_K / Q5_K: c (d sc_j) and dmin m_j, the 8 sub-blocks
  __m256i sc16;             // Q6_K: the 16 scales as int16 (the offset of 32 through the 16-sums)
  float d;
};

// pshufb masks: int16 element j of each 128-bit lane into every element of that lane (k[j]); Q6_K's group t of a
// half: element 2t on the low lane and 2t + 1 on the high one (q6[t])
struct ScaleMasks {
  alignas(32) uint8_t k[8][32];
  alignas(32) uint8_t q6[4][32];
};
inline ScaleMasks make_scale_masks() {
  ScaleMasks m;
  for (int i = 0; i < 32; ++i) {
    for (int j = 0; j < 8; ++j) m.k[j][i] = static_cast<uint8_t>(2 * j + (i & 1));
    for (int t = 0; t < 4; ++t) m.q6[t][i] = static_cast<uint8_t>(2 * (2 * t + i / 16) + (i & 1));
  }
  return m;
}
const ScaleMasks kScaleMasks = make_scale_masks();
inline __m256i mask_of(const uint8_t* m) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(m)); }

// Q4_K / Q5_K: sub-block j's 32 weights are chunk c = j / 2 of the nibbles, low (j even) or high (j odd); Q5_K's
// fifth bit is bit j of qh[l]. isum = sum_j sc_j (q_j . xq_j); the minimums and the codes' mean c from the float
// sums (see the top).
template <bool kFifthBit, class F>
inline void decode_k(const uint8_t* b, const uint8_t* qs, KFloats& k, F&& f) {
  const __m128i sc_mins = k_scales(b);
  const __m256i m4 = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);
  const __m256i sc_both = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sc_mins));  // the 8 scales, int16, both lanes
  const __m256i qh = kFifthBit ? load32(b + 16) : _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m256i raw = load32(qs + 32 * c);
    __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    if constexpr (kFifthBit) {  // bits 2c and 2c + 1 of each byte moved to bit 4 (16-bit shifts, then a byte mask)
      const __m256i h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c));
      lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(h, 4), bit4));
      hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(h, 3), bit4));
    }
    f(2 * c, lo, _mm256_shuffle_epi8(sc_both, mask_of(kScaleMasks.k[2 * c])));
    f(2 * c + 1, hi, _mm256_shuffle_epi8(sc_both, mask_of(kScaleMasks.k[2 * c + 1])));
  }
  // the 8 sub-blocks' d sc_j and dmin m_j as float32 vectors (the spec's products), then c (d sc_j); d and dmin
  // converted together, [d, dmin] in every pair of lanes
  constexpr float kCentre = kFifthBit ? 15.5f : 7.5f;
  const __m256 d_dmin = _mm256_cvtph_ps(_mm_castps_si128(_mm_broadcast_ss(reinterpret_cast<const float*>(b))));
  const __m256 d = _mm256_moveldup_ps(d_dmin);
  k.d = _mm256_cvtss_f32(d);
  const __m256 scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc_mins)));
  k.minimum = _mm256_mul_ps(_mm256_movehdup_ps(d_dmin),
                            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(sc_mins, sc_mins))));
  k.centred = _mm256_mul_ps(scale, _mm256_set1_ps(kCentre));
}

struct Q4_K {
  static constexpr int64_t kWeights = 256, kBytes = 144, kActBlock = 256;
  static constexpr bool kSums = false;
  template <class F>
  static void decode(const uint8_t* b, KFloats& k, F&& f) { decode_k<false>(b, b + 16, k, f); }
};

struct Q5_K {
  static constexpr int64_t kWeights = 256, kBytes = 176, kActBlock = 256;
  static constexpr bool kSums = false;
  template <class F>
  static void decode(const uint8_t* b, KFloats& k, F&& f) { decode_k<true>(b, b + 48, k, f); }
};

// Q6_K: half h (128 weights) holds groups t = 0..3 of 32: low nibbles of ql[64h + 32 (t % 2) + l] >> 4 (t / 2), high
// two bits of qh[32h + l] >> 2t; one int8 scale per 16 weights. q in 0..63 multiplies x unsigned, and the offset of
// 32 comes from the 16-sums: isum = sum_g sc_g (q_g . x_g) - 32 sum_g sc_g S_g.
struct Q6_K {
  static constexpr int64_t kWeights = 256, kBytes = 210, kActBlock = 256;
  static constexpr bool kSums = true;
  template <class F>
  static void decode(const uint8_t* b, KFloats& k, F&& f) {
    const __m256i m4 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(48);
    k.sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      // scales 8h..8h + 7 as int16 on both lanes: group t of the half takes 8h + 2t low, 8h + 2t + 1 high
      const __m256i half = _mm256_broadcastsi128_si256(h == 0 ? _mm256_castsi256_si128(k.sc16)
                                                              : _mm256_extracti128_si256(k.sc16, 1));
      const __m256i l0 = load32(b + 64 * h), l1 = load32(b + 64 * h + 32), hb = load32(b + 128 + 32 * h);
      f(4 * h, _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m48)),
        _mm256_shuffle_epi8(half, mask_of(kScaleMasks.q6[0])));
      f(4 * h + 1, _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m48)),
        _mm256_shuffle_epi8(half, mask_of(kScaleMasks.q6[1])));
      f(4 * h + 2, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m48)),
        _mm256_shuffle_epi8(half, mask_of(kScaleMasks.q6[2])));
      f(4 * h + 3,
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(hb, 2), m48)),
        _mm256_shuffle_epi8(half, mask_of(kScaleMasks.q6[3])));
    }
    k.d = f16(b + 208);
  }
};

// v as it is here, in a register. Without it GCC reassociates each row's 8 group sums of a block into a tree
// computed after all the tile's products, and so spills every product to the stack (64 stores and reloads a block
// at 8 rows), which cost the many-row tiles 15-20% of their time. (One row has no such spill: its code is the
// same with or without.)
inline void in_register(__m256i& v) { asm("" : "+x"(v)); }

// One (channel, row) pair's float step for a block: the same operations in the same order in every tile.
template <class Type>
inline __m256 k_accumulate(__m256 acc, __m256i isum, const KFloats& k, float step, const int16_t* sums,
                           const float* sub_sum, const float* sub_error) {
  if constexpr (Type::kSums) {
    const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(load32(sums), k.sc16), 5);
    return _mm256_fmadd_ps(_mm256_set1_ps(step * k.d), _mm256_cvtepi32_ps(_mm256_sub_epi32(isum, offset)), acc);
  } else {
    acc = _mm256_fmadd_ps(_mm256_set1_ps(step * k.d), _mm256_cvtepi32_ps(isum), acc);
    acc = _mm256_fmadd_ps(k.centred, _mm256_loadu_ps(sub_error), acc);
    return _mm256_fnmadd_ps(k.minimum, _mm256_loadu_ps(sub_sum), acc);
  }
}

// ---- tiles and work items

struct Problem {
  const GgufMatmul* m;
  const Int8Rows* rows;
};

template <class Type, int NT>
__attribute__((noinline)) void tile(const Problem& p, int64_t n, int64_t t0) {
  const GgufMatmul& m = *p.m;
  const Int8Rows& a = *p.rows;
  const uint8_t* w = m.w + n * m.row_bytes;
  const int64_t nb = m.K / Type::kWeights, act_blocks = m.K / Type::kActBlock;
  RowPtrs<NT> rows;
  __m256 acc[NT];
  for (int r = 0; r < NT; ++r) {
    rows.q[r] = a.q.data() + (t0 + r) * m.K;
    rows.step[r] = a.step.data() + (t0 + r) * act_blocks;
    rows.sums[r] = a.sums.empty() ? nullptr : a.sums.data() + (t0 + r) * (m.K / kSumGroup);
    rows.sub_sum[r] = a.sub_sum.empty() ? nullptr : a.sub_sum.data() + (t0 + r) * (m.K / 32);
    rows.sub_error[r] = a.sub_error.empty() ? nullptr : a.sub_error.data() + (t0 + r) * (m.K / 32);
    acc[r] = _mm256_setzero_ps();
  }
  for (int64_t blk = 0; blk < nb; ++blk, w += Type::kBytes) {
    Type::template block<NT>(w, rows, acc);
    for (int r = 0; r < NT; ++r) {
      rows.q[r] += Type::kWeights;
      rows.step[r] += 1;  // one activation block a weight block (kActBlock == kWeights)
      if (rows.sums[r] != nullptr) rows.sums[r] += Type::kWeights / kSumGroup;
      if (rows.sub_sum[r] != nullptr) rows.sub_sum[r] += Type::kWeights / 32, rows.sub_error[r] += Type::kWeights / 32;
    }
  }
  const float bias = m.bias ? m.bias[n] : 0.f;
  for (int r = 0; r < NT; ++r) m.y[(t0 + r) * m.N + n] = hsum(acc[r]) + bias;
}

template <class Type, int NT>
void pass_rows(const Problem& p, int64_t n, int64_t t0, int64_t rows) {
  if constexpr (NT > 1)
    if (rows < NT) return pass_rows<Type, NT - 1>(p, n, t0, rows);
  tile<Type, NT>(p, n, t0);
}

template <class Type>
void run_item(const Problem& p, int64_t n_begin, int64_t n_end, int64_t t_begin, int64_t t_end) {
  static_assert(Type::kActBlock == Type::kWeights, "an activation block per weight block");
  for (int64_t t = t_begin; t < t_end; t += kTileRows) {
    const int64_t rows = std::min<int64_t>(kTileRows, t_end - t);
    for (int64_t n = n_begin; n < n_end; ++n) pass_rows<Type, kTileRows>(p, n, t, rows);
  }
}

// The k-quants' tile: output channels [n_begin, n_end) one after the other, each x NT rows over its whole row of
// blocks, each block decoded once, group by group straight into the NT rows' dots (codes, multipliers and the rows'
// integer sums all in registers), then the block's float terms once for the NT rows. One call takes the channels of
// an item, so the row pointers and the scale masks are set up once for them, not once a channel (a K = 2048 row is
// only 8 blocks). A (channel, row) pair runs the same integer and float operations in the same order (its blocks
// in order) in every tile size, so a row's bits depend on neither T nor the tiling.
template <class Type, int NT>
__attribute__((noinline)) void k_tile(const Problem& p, int64_t n_begin, int64_t n_end, int64_t t0) {
  const GgufMatmul& m = *p.m;
  const Int8Rows& a = *p.rows;
  const int64_t nb = m.K / Type::kWeights;
  const int8_t* xq[NT];
  const float* step[NT];
  const int16_t* sums[NT];
  const float *sub_sum[NT], *sub_error[NT];
  for (int r = 0; r < NT; ++r) {
    const int64_t t = t0 + r;
    xq[r] = a.q.data() + t * m.K;
    step[r] = a.step.data() + t * nb;
    sums[r] = Type::kSums ? a.sums.data() + t * (m.K / kSumGroup) : nullptr;
    sub_sum[r] = Type::kSums ? nullptr : a.sub_sum.data() + t * (m.K / 32);
    sub_error[r] = Type::kSums ? nullptr : a.sub_error.data() + t * (m.K / 32);
  }
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* w = m.w + n * m.row_bytes;
    __m256 acc[NT];
    for (int r = 0; r < NT; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < nb; ++blk, w += Type::kBytes) {
      for (int64_t off = 0; off < Type::kBytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchAhead + off, _MM_HINT_T0);
      KFloats k;
      __m256i isum[NT];
      for (int r = 0; r < NT; ++r) isum[r] = _mm256_setzero_si256();
      Type::decode(w, k, [&](int g, __m256i q, __m256i s) {
        for (int r = 0; r < NT; ++r) {
          isum[r] = _mm256_add_epi32(isum[r], dot_bytes(q, load32(xq[r] + blk * Type::kWeights + 32 * g), s));
          if constexpr (NT > 1) in_register(isum[r]);
        }
      });
      for (int r = 0; r < NT; ++r)
        acc[r] = k_accumulate<Type>(acc[r], isum[r], k, step[r][blk], sums[r] + blk * (Type::kWeights / kSumGroup),
                                    sub_sum[r] + blk * (Type::kWeights / 32), sub_error[r] + blk * (Type::kWeights / 32));
    }
    const float bias = m.bias ? m.bias[n] : 0.f;
    for (int r = 0; r < NT; ++r) m.y[(t0 + r) * m.N + n] = hsum(acc[r]) + bias;
  }
}

template <class Type, int NT>
void k_pass_rows(const Problem& p, int64_t n_begin, int64_t n_end, int64_t t0, int64_t rows) {
  if constexpr (NT > 1)
    if (rows < NT) return k_pass_rows<Type, NT - 1>(p, n_begin, n_end, t0, rows);
  k_tile<Type, NT>(p, n_begin, n_end, t0);
}

// An item's rows in tiles of kKTileRows, or kTileRows where so many rows' int8 activations would not stay in L1
// while a channel's row of blocks streams past them (K above kKTileRowsMaxK: 8 rows of 8192 are 64 KiB).
template <class Type>
void run_k_item(const Problem& p, int64_t n_begin, int64_t n_end, int64_t t_begin, int64_t t_end) {
  static_assert(Type::kActBlock == Type::kWeights, "an activation block per weight block");
  const int64_t tile_rows = p.m->K <= kKTileRowsMaxK ? kKTileRows : kTileRows;
  for (int64_t t = t_begin; t < t_end; t += tile_rows)
    k_pass_rows<Type, kKTileRows>(p, n_begin, n_end, t, std::min<int64_t>(tile_rows, t_end - t));
}

using ItemFn = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t);

struct Kernel {
  Layout layout;
  ItemFn item;
};

Kernel kernel_of(int64_t ggml_type) {
  switch (ggml_type) {
    case 2: return {{Q4_0::kActBlock, false, false}, &run_item<Q4_0>};
    case 8: return {{Q8_0::kActBlock, false, false}, &run_item<Q8_0>};
    case 12: return {{Q4_K::kActBlock, false, true}, &run_k_item<Q4_K>};
    case 13: return {{Q5_K::kActBlock, false, true}, &run_k_item<Q5_K>};
    default: return {{Q6_K::kActBlock, true, false}, &run_k_item<Q6_K>};  // 14: the caller validated the type
  }
}

}  // namespace

namespace gguf_int8 {

bool block_type(int64_t ggml_type, GgufBlockType& out) {
  switch (ggml_type) {
    case 2: out = {Q4_0::kWeights, Q4_0::kBytes, "Q4_0"}; return true;
    case 8: out = {Q8_0::kWeights, Q8_0::kBytes, "Q8_0"}; return true;
    case 12: out = {Q4_K::kWeights, Q4_K::kBytes, "Q4_K"}; return true;
    case 13: out = {Q5_K::kWeights, Q5_K::kBytes, "Q5_K"}; return true;
    case 14: out = {Q6_K::kWeights, Q6_K::kBytes, "Q6_K"}; return true;
    default: return false;
  }
}

Layout layout_of(int64_t ggml_type) { return kernel_of(ggml_type).layout; }

void Int8Rows::reset(int64_t T, int64_t K_, const Layout& layout) {
  K = K_, block = layout.block;
  q.resize(T * K);
  step.resize(T * (K / block));
  sums.resize(layout.sums ? T * (K / kSumGroup) : 0);
  sub_sum.resize(layout.sub_sums ? T * (K / 32) : 0);
  sub_error.resize(layout.sub_sums ? T * (K / 32) : 0);
}

void quantize_rows(OrtKernelContext* ctx, const Layout& layout, const float* const* rows, int64_t T, int64_t K,
                   Int8Rows& out) {
  out.reset(T, K, layout);
  const int64_t act_blocks = K / layout.block;
  auto quantize = [&](size_t t) {
    quantize_row(rows[t], K, layout.block, out.q.data() + t * K, out.step.data() + t * act_blocks,
                 layout.sums ? out.sums.data() + t * (K / kSumGroup) : nullptr,
                 layout.sub_sums ? out.sub_sum.data() + t * (K / 32) : nullptr,
                 layout.sub_sums ? out.sub_error.data() + t * (K / 32) : nullptr);
  };
  if (T * K >= kParallelQuantize) parallel_for(ctx, static_cast<size_t>(T), quantize);
  else for (int64_t t = 0; t < T; ++t) quantize(static_cast<size_t>(t));
}

void run_item(int64_t ggml_type, const GgufMatmul& m, const Int8Rows& a, int64_t n0, int64_t n1, int64_t t0,
              int64_t t1) {
  kernel_of(ggml_type).item(Problem{&m, &a}, n0, n1, t0, t1);
}

}  // namespace gguf_int8

void matmul_gguf_int8(OrtKernelContext* ctx, int64_t ggml_type, const GgufMatmul& m) {
  const Kernel kernel = kernel_of(ggml_type);
  // Decode-sized rows reuse a scratch of the calling thread; larger batches allocate their own.
  thread_local Int8Rows scratch;
  Int8Rows local;
  Int8Rows& rows = m.T <= kRowsPerItem ? scratch : local;
  std::vector<const float*> x(m.T);
  for (int64_t t = 0; t < m.T; ++t) x[t] = m.x + t * m.K;
  gguf_int8::quantize_rows(ctx, kernel.layout, x.data(), m.T, m.K, rows);

  const Problem p{&m, &rows};
  const int64_t channel_chunks = (m.N + kChannelsPerItem - 1) / kChannelsPerItem;
  const int64_t row_chunks = (m.T + kRowsPerItem - 1) / kRowsPerItem;
  auto item = [&](size_t i) {
    const int64_t c = static_cast<int64_t>(i) % channel_chunks, r = static_cast<int64_t>(i) / channel_chunks;
    kernel.item(p, c * kChannelsPerItem, std::min(m.N, (c + 1) * kChannelsPerItem), r * kRowsPerItem,
                std::min(m.T, (r + 1) * kRowsPerItem));
  };
  parallel_for(ctx, static_cast<size_t>(channel_chunks * row_chunks), item);
}

}  // namespace kiln
