// kiln.MatMulQ4_1 (domain "kiln", version 1): the ONNX Runtime CPU kernel.
//
// The contract (inputs, weight layout, semantics) is written once, with its numpy reference
// implementation, in kiln/matmul_q4_1.py; this file implements it.
//
//   1. validate the shapes;
//   2. quantize each activation row per block of 32 to int8 (step max|x| / 127, exact float sum and
//      what int8 loses of it), zero-padded to whole block pairs and to whole groups of 8 steps, each
//      block pair's bytes interleaved (interleave_pair) and its steps laid out for the FMA;
//   3. work items (a chunk of output channels x a chunk of activation rows) run on ONNX Runtime's
//      intra-op thread pool. Up to 16 rows (decode, speculative verification, small batches; 32 in the
//      VNNI build) the weights are read straight from qs and dm, each block pair unpacked in registers
//      once and applied to up to 7 rows (16 in the VNNI build; tiles of 4, 2 or 1 channels), prefetching
//      ahead; with more rows each pair of channels is unpacked once per item into a buffer and feeds
//      tiles of 4 rows. A block pair's dot is two _mm256_maddubs_epi16 (unsigned nibbles x signed
//      int8) + _mm256_madd_epi16 into int32, scaled by d * xs in float; the minimum's term
//      sum_b m * sum(x_block) and the centring term (see the spec) are separate 8-wide dots per tile.
//
// Built with -O3 -mavx2 -mfma -mf16c, and once more with AVX-512 VNNI (build_ops.VARIANTS), where a step
// takes two block pairs in zmm registers and their dot is two vpdpbusd: the same int32 sums, the float
// sums in another order (even and odd pairs apart, then added, then an odd last pair in ymm registers),
// so the two builds agree to rounding.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "matmul_q4_1.h"
#include "shape_text.h"
#include "simd.h"

namespace kiln {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPairBytes = 32;          // the nibbles of two blocks
constexpr int64_t kChannelsPerItem = 32;    // output channels per work item (a multiple of 4)
constexpr int64_t kRowsPerItem = 32;        // activation rows per work item
// A tile for T > 1: 2 channels x 4 rows, 8 accumulators (measured against 4 x 2, 3 x 3 and 3 x 4:
// each channel's unpacked pair and steps serve 4 rows, and nothing spills).
constexpr int kTileChannels = 2;
constexpr int kTileRows = 4;
// Up to kStreamRows rows the weights are unpacked in registers straight from qs/dm and applied to up to
// kPassRows rows at a time (tile_stream), as decode does: with AVX2 faster than the unpacked tiles up to 16
// rows, slower from 24. AVX2's 16 ymm registers hold 8 accumulators a tile: a 1 x 8 tile measured 35% slower
// than 1 x 7 (it spills), so 8 rows are a pass of 7 and one of 1 (docs/design.md, "MatMulQ4_1 with few rows").
// AVX-512VL gives the VNNI build 32 ymm registers: a pass covers 16 rows (16 accumulators, the weights' 3
// registers and the dot's temporaries), each block pair unpacked once for all of them, and two such passes
// beat the unpacked tiles at 32 rows too (docs/design.md, "An AVX-512 VNNI copy of the op library").
#if defined(__AVX512VL__)
constexpr int kAccumulators = 16;
constexpr int64_t kPassRows = 16;
constexpr int64_t kStreamRows = 32;
#else
constexpr int kAccumulators = 8;
constexpr int64_t kPassRows = 7;
constexpr int64_t kStreamRows = 16;
#endif
// The dot loop's step: one block pair in ymm registers (AVX2), or two in zmm registers in the VNNI build, where
// each instruction does the work of two and a decode step measured 7% faster on one thread, 5% on two (docs/
// design.md, "Two block pairs a step"). Every path of one build sums a (channel, row) in the same order, so a
// row's outputs stay bitwise the same for every T; the two builds differ in the last bits.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define KILN_Q4_ZMM 1
// GCC 12's AVX-512 headers make their "undefined" operands with `__Y = __Y`, which -Wall reports at every
// inlined use (GCC bug 105593, fixed in 13): not our code's uninitialized values.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
constexpr int64_t kPairsPerStep = 2;
#else
constexpr int64_t kPairsPerStep = 1;
#endif
constexpr int64_t kPrefetchChannels = 4;  // how far ahead tile_stream prefetches the weights
constexpr int64_t kParallelQuantize = 1 << 15;  // activation elements from which quantizing is parallel

[[noreturn]] void fail_q4(const std::string& msg) {
  throw Ort::Exception("kiln.MatMulQ4_1: " + msg, ORT_INVALID_ARGUMENT);
}

template <typename F>
void parallel_for_q4(OrtKernelContext* ctx, size_t n, F& f) {
  if (n == 0) return;
  if (n == 1) return f(0);
  Ort::KernelContext(ctx).ParallelFor([](void* fn, size_t i) { (*static_cast<F*>(fn))(i); }, n, 0, &f);
}

// std::vector's storage on 64-byte boundaries: the kernels' 32-byte loads of the rows never straddle a
// cache line (malloc's 16-byte alignment made every other one split).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* ptr, size_t) { ::operator delete(ptr, std::align_val_t(64)); }
  bool operator==(const CacheLineAllocator&) const { return true; }
  bool operator!=(const CacheLineAllocator&) const { return false; }
};
template <typename T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

// Activation rows quantized per block of 32: llama.cpp's q8_1, with the block sums in float.
// Rows are padded with zeros: q to whole block pairs, sum and sum_error to whole groups of 8 blocks.
struct Int8Rows {
  int64_t q_stride = 0, step_stride = 0, s_stride = 0;
  AlignedVector<int8_t> q;         // [T, q_stride]: 64 bytes a pair, interleaved (see interleave_pair); with two
                                   // pairs a step, the A halves of pairs j, j + 1, then their B halves
  AlignedVector<float> step;       // [T, step_stride]: per block pair j, (xs0, xs0, xs1, xs1) twice (see tile)
  AlignedVector<float> sum;        // [T, s_stride]
  AlignedVector<float> sum_error;  // [T, s_stride]: sum(x) - xs * sum(xq), what int8 loses of the block sum

  // T rows of these strides, all zeros (the padding must be).
  void reset(int64_t T, int64_t q_stride_, int64_t step_stride_, int64_t s_stride_) {
    q_stride = q_stride_, step_stride = step_stride_, s_stride = s_stride_;
    q.assign(T * q_stride, 0);
    step.assign(T * step_stride, 0.f);
    sum.assign(T * s_stride, 0.f);
    sum_error.assign(T * s_stride, 0.f);
  }
};

// The 64 bytes of a block pair (a, b) -> (A, B): A = a[0:8] b[8:16] a[16:24] b[24:32] and
// B = a[8:16] b[0:8] a[24:32] b[16:24]. Applied to both the weights' nibbles and the activations,
// maddubs(A_w, A_x) + maddubs(B_w, B_x) holds block a's products in int16 lanes 0-3 of each 128-bit
// half and block b's in lanes 4-7: the two blocks' dots are separated without a (slow) hadd.
inline void interleave_pair(__m256i a, __m256i b, __m256i& A, __m256i& B) {
  A = _mm256_blend_epi32(a, b, 0xCC);
  B = _mm256_shuffle_epi32(_mm256_blend_epi32(a, b, 0x33), _MM_SHUFFLE(1, 0, 3, 2));
}

// Quantizes nb blocks of x into q (pairs * 64 bytes, each pair interleaved; an odd nb's last
// pair has a zero second block), their steps into step8 and their float sums.
void quantize_row(const float* x, int64_t nb, int8_t* q, float* step8, float* sum, float* sum_error) {
  int8_t* const q_row = q;
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes packs' lane interleave
  for (int64_t b = 0; b < nb; ++b, x += kBlock, q += kBlock) {
    const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
    const __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
    const __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float step = _mm_cvtss_f32(h) / 127.f;
    const __m256 inv = _mm256_set1_ps(step > 0.f ? 1.f / step : 0.f);
    float* lanes = step8 + (b / 2) * 8 + (b % 2) * 2;  // this block's lanes of its pair: 2 of each 4
    lanes[0] = lanes[1] = lanes[4] = lanes[5] = step;
    sum[b] = hsum(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // half to even, as np.rint
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, inv), kRound));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, inv), kRound));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, inv), kRound));
    const __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, inv), kRound));
    const __m256i isum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    sum_error[b] = sum[b] - step * hsum(_mm256_cvtepi32_ps(isum));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, order));
  }
  const int64_t pairs = (nb + 1) / 2;
  for (int64_t j = 0; j < pairs; j += kPairsPerStep) {
    __m256i* step = reinterpret_cast<__m256i*>(q_row + j * 2 * kBlock);
    __m256i A0, B0;
    interleave_pair(_mm256_loadu_si256(step), _mm256_loadu_si256(step + 1), A0, B0);
#ifdef KILN_Q4_ZMM
    __m256i A1 = _mm256_setzero_si256(), B1 = _mm256_setzero_si256();  // an odd last pair's partner: zeros
    if (j + 1 < pairs) interleave_pair(_mm256_loadu_si256(step + 2), _mm256_loadu_si256(step + 3), A1, B1);
    _mm256_storeu_si256(step, A0);
    _mm256_storeu_si256(step + 1, A1);
    _mm256_storeu_si256(step + 2, B0);
    _mm256_storeu_si256(step + 3, B1);
#else
    _mm256_storeu_si256(step, A0);
    _mm256_storeu_si256(step + 1, B0);
#endif
  }
}

// Pairs rounded up to whole steps: the rows' and the unpacked weights' buffers hold zeros past the last pair.
inline int64_t padded_pairs(int64_t pairs) { return (pairs + kPairsPerStep - 1) / kPairsPerStep * kPairsPerStep; }

struct Problem {
  const uint8_t* qs;    // [N, pairs, 32]
  const uint16_t* dm;   // [N, 2, nb] float16: d then m
  const float* bias;    // [N] or nullptr
  const Int8Rows* x;
  float* y;             // [T, N]
  int64_t N, nb, pairs;
};

// 8 float16 at p as floats, lanes from `count` on zeroed. `readable` says whether all 8 may be read
// (they lie inside dm: a tail then reads the next plane's numbers, which the mask drops).
inline __m256 load_f16x8(const uint16_t* p, int64_t count, bool readable) {
  if (count >= 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if (!readable) {
    alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(tmp, p, static_cast<size_t>(count) * sizeof(uint16_t));
    return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp)));
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lane));
  return _mm256_and_ps(keep, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// One (channel, row) dot of a block pair, accumulated: maddubs(wa, xa) + maddubs(wb, xb) holds block
// 2j's sums in int16 lanes 0-3 and 2j + 1's in 4-7 of each half (see interleave_pair), one madd folds
// them into int32 lanes 0-1, 4-5 and 2-3, 6-7, and one float FMA scales them by the steps laid out
// the same way: the channel's (d0, d0, d1, d1) twice times the row's (xs0, xs0, xs1, xs1) twice.
inline __m256 accumulate_pair(__m256i wa, __m256i wb, const int8_t* x, __m256 d, const float* xstep, __m256 acc) {
  const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + kBlock));
  const __m256i sums = _mm256_add_epi16(_mm256_maddubs_epi16(wa, xa), _mm256_maddubs_epi16(wb, xb));
  const __m256i dots = _mm256_madd_epi16(sums, _mm256_set1_epi16(1));
  const __m256 step = _mm256_mul_ps(d, _mm256_loadu_ps(xstep));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), step, acc);
}

// Channel c's block pair j: its nibbles unpacked and interleaved, its steps as (d0, d0, d1, d1) twice
// (for an odd nb the last pair's d1 reads m[0]: its x is 0).
inline void unpack_pair(const uint8_t* qs, const uint16_t* d, __m256i& wa, __m256i& wb, __m256& step) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  interleave_pair(_mm256_and_si256(raw, low), _mm256_and_si256(_mm256_srli_epi16(raw, 4), low), wa, wb);
  int32_t d01;
  std::memcpy(&d01, d, sizeof(d01));
  step = _mm256_permute_ps(_mm256_cvtph_ps(_mm_set1_epi32(d01)), _MM_SHUFFLE(1, 1, 0, 0));
}

// One step's weights of a channel, unpacked: kPairsPerStep block pairs.
#ifdef KILN_Q4_ZMM
using Acc = __m512;
struct StepWeights {
  __m512i a, b;  // the A halves of pairs j, j + 1, and their B halves
  __m512 d;      // both pairs' steps, laid out as unpack_pair's
};

inline Acc zero_acc() { return _mm512_setzero_ps(); }

// Pairs j and j + 1 (kTwo: whether j + 1 exists; if not, its lanes are zero) of a channel, from qs at pair j and
// the d plane at block 2j.
template <bool kTwo>
inline void unpack_step(const uint8_t* qs, const uint16_t* d, StepWeights& w) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i raw = kTwo ? _mm512_loadu_si512(qs) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, qs);
  const __m512i a = _mm512_and_si512(raw, low), b = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
  w.a = _mm512_mask_blend_epi32(0xCCCC, a, b);  // interleave_pair in each 256-bit half
  w.b = _mm512_shuffle_epi32(_mm512_mask_blend_epi32(0x3333, a, b), static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(1, 0, 3, 2)));
  int64_t d4 = 0;  // d0 d1 (d2 d3): no read past the plane for an odd last pair
  std::memcpy(&d4, d, kTwo ? 8 : 4);
  const __m512i lanes = _mm512_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3);
  w.d = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi64_si128(d4))));
}

inline void load_step(const int8_t* w, const float* d, StepWeights& out) {
  out.a = _mm512_loadu_si512(w);
  out.b = _mm512_loadu_si512(w + 2 * kPairBytes);
  out.d = _mm512_loadu_ps(d);
}

inline void store_step(const StepWeights& in, int8_t* w, float* d) {
  _mm512_storeu_si512(w, in.a);
  _mm512_storeu_si512(w + 2 * kPairBytes, in.b);
  _mm512_storeu_ps(d, in.d);
}

// accumulate_pair for two pairs: x holds their A halves then their B halves, xstep both pairs' 8 steps. Each
// vpdpbusd sums 4 adjacent products into an int32 lane, so a 256-bit half's lanes hold its pair's two blocks
// as madd's do, with the same int32 sums (a nibble times |x| <= 127, twice, never saturates int16 either).
inline Acc accumulate_step(const StepWeights& w, const int8_t* x, const float* xstep, Acc acc) {
  const __m512i xa = _mm512_loadu_si512(x), xb = _mm512_loadu_si512(x + 2 * kBlock);
  const __m512i dots = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w.a, xa), w.b, xb);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(w.d, _mm512_loadu_ps(xstep)), acc);
}

// The even pairs' lanes plus the odd pairs': the 8 lanes every path then finishes alike.
inline __m256 fold(Acc acc) {
  return _mm256_add_ps(_mm512_castps512_ps256(acc), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
}

// A channel's odd last pair (K = 576 has 9 pairs: SmolLM2's q/k/v, o and gate/up) in ymm registers, added to the
// folded sums: a zmm step with an empty second pair measured 7-9% of those calls. x holds the pair's A half at 0
// and its B half at 2 * kBlock (the zmm layout, the empty pair's halves between), xstep its 8 steps.
inline __m256 accumulate_odd_pair(__m256i wa, __m256i wb, const int8_t* x, __m256 d, const float* xstep, __m256 acc) {
  const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 2 * kBlock));
  const __m256i dots = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), wa, xa), wb, xb);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(d, _mm256_loadu_ps(xstep)), acc);
}
#else
using Acc = __m256;
struct StepWeights {
  __m256i a, b;
  __m256 d;
};

inline Acc zero_acc() { return _mm256_setzero_ps(); }
template <bool kTwo>
inline void unpack_step(const uint8_t* qs, const uint16_t* d, StepWeights& w) { unpack_pair(qs, d, w.a, w.b, w.d); }

inline void load_step(const int8_t* w, const float* d, StepWeights& out) {
  out.a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  out.b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kBlock));
  out.d = _mm256_loadu_ps(d);
}

inline void store_step(const StepWeights& in, int8_t* w, float* d) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w), in.a);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + kBlock), in.b);
  _mm256_storeu_ps(d, in.d);
}

inline Acc accumulate_step(const StepWeights& w, const int8_t* x, const float* xstep, Acc acc) {
  return accumulate_pair(w.a, w.b, x, w.d, xstep, acc);
}

inline __m256 fold(Acc acc) { return acc; }
#endif

// y[rows t0.., channels n0..] = the tile's accumulators summed (+ bias). Every accumulator is summed
// in hsum4's order, whatever the tile's shape: a row's outputs are then bitwise the same in every path
// and for every T (speculative verification reproduces decode's logits exactly).
template <int NC, int NT>
void store_tile(const Problem& p, const __m256 (&acc)[NC][NT], int64_t n0, int64_t t0) {
  if constexpr (NC % 4 == 0) {  // 4 channels of a row at a time, stored as a vector
    for (int r = 0; r < NT; ++r) {
      float* y = p.y + (t0 + r) * p.N + n0;
      for (int c = 0; c < NC; c += 4) {
        __m128 v = hsum4(acc[c][r], acc[c + 1][r], acc[c + 2][r], acc[c + 3][r]);
        if (p.bias) v = _mm_add_ps(v, _mm_loadu_ps(p.bias + n0 + c));
        _mm_storeu_ps(y + c, v);
      }
    }
  } else {  // any 4 accumulators at a time, stored one by one
    constexpr int kCount = NC * NT, kPadded = (kCount + 3) / 4 * 4;
    __m256 flat[kPadded];
    for (int i = 0; i < kCount; ++i) flat[i] = acc[i / NT][i % NT];
    for (int i = kCount; i < kPadded; ++i) flat[i] = _mm256_setzero_ps();
    alignas(16) float sums[kPadded];
    for (int i = 0; i < kPadded; i += 4) _mm_store_ps(sums + i, hsum4(flat[i], flat[i + 1], flat[i + 2], flat[i + 3]));
    for (int c = 0; c < NC; ++c)
      for (int r = 0; r < NT; ++r)
        p.y[(t0 + r) * p.N + n0 + c] = p.bias ? sums[c * NT + r] + p.bias[n0 + c] : sums[c * NT + r];
  }
}

// A prefetch of weights that tile_stream reads `once` per call (its rows fit one pass) is non-temporal: the
// weights, ~80 MB a decode step, would otherwise evict from L2 and L3 what the rest of the step reads next (the
// activations, the KV cache, ONNX Runtime's and the Python runtime's own data): single-stream steps measured
// 0.92-0.94 of T0's in three paired sittings and 0.97-1.0 in four on a busier host, never slower (docs/design.md,
// "Session 16"). With more passes, the later ones re-read
// the item's weights from the caches, so those prefetches keep them. Always inlined: GCC takes a function that
// only prefetches for one without effects and drops its calls.
__attribute__((always_inline)) inline void prefetch_weights(const void* p, bool once) {
  if (once) _mm_prefetch(static_cast<const char*>(p), _MM_HINT_NTA);
  else _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}

// One whole step of tile_stream (kPairsPerStep pairs from j) of NC channels applied to NT rows. Always inlined, so
// the accumulators stay in registers.
template <int NC, int NT>
__attribute__((always_inline)) inline void stream_step(const Problem& p, const uint8_t* w, const uint16_t* dm,
                                                       const int8_t* xq, const float* xstep, int64_t j, bool once,
                                                       Acc (&sums)[NC][NT]) {
  const Int8Rows& x = *p.x;
  const int64_t w_stride = p.pairs * kPairBytes, dm_stride = 2 * p.nb;
#pragma GCC unroll 4
  for (int c = 0; c < NC; ++c) {
    prefetch_weights(w + (kPrefetchChannels + c) * w_stride + j * kPairBytes, once);
    if (j * 32 < dm_stride)  // 32 float16 a cache line
      prefetch_weights(dm + (kPrefetchChannels + c) * dm_stride + j * 32, once);
    StepWeights wt;
    unpack_step<true>(w + c * w_stride + j * kPairBytes, dm + c * dm_stride + 2 * j, wt);
#pragma GCC unroll 16  // every accumulator in a register (GCC leaves 16 zmm rows rolled, in memory, without it)
    for (int r = 0; r < NT; ++r)
      sums[c][r] = accumulate_step(wt, xq + r * x.q_stride + j * 2 * kBlock, xstep + r * x.step_stride + j * 8,
                                   sums[c][r]);
  }
}

// Few rows (T <= kStreamRows, speculative verification and small batches): y for channels [n0, n0 + NC)
// x rows [t0, t0 + NT), each block pair of the weights read straight from qs and dm, unpacked in
// registers once and applied to all NT rows. The weights kPrefetchChannels channels ahead are prefetched
// (a call streams its weights from DRAM: the model's layers do not fit the caches; a prefetch past the
// tensor does not fault). Per (channel, row) the arithmetic and its order are those of tile_rows.
template <int NC, int NT>
void tile_stream(const Problem& p, int64_t n0, int64_t t0, bool once) {
  static_assert(NC * NT <= kAccumulators,
                "the accumulators, the weights' 3 registers and the dot's temporaries fit the ymm registers");
  const Int8Rows& x = *p.x;
  const uint8_t* w = p.qs + n0 * p.pairs * kPairBytes;
  const uint16_t* dm = p.dm + n0 * 2 * p.nb;
  const int64_t dm_stride = 2 * p.nb;
  const int8_t* xq = x.q.data() + t0 * x.q_stride;
  const float* xstep = x.step.data() + t0 * x.step_stride;
  Acc sums[NC][NT];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < NT; ++r) sums[c][r] = zero_acc();
  const int64_t whole = p.pairs / kPairsPerStep * kPairsPerStep;  // pairs in whole steps; an odd last one after
  for (int64_t j = 0; j < whole; j += kPairsPerStep) stream_step<NC, NT>(p, w, dm, xq, xstep, j, once, sums);
  __m256 acc[NC][NT];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < NT; ++r) acc[c][r] = fold(sums[c][r]);
#ifdef KILN_Q4_ZMM
  if (whole < p.pairs) {  // the odd last pair, after the fold (tile_rows does the same: rows stay bitwise alike)
    const int64_t w_stride = p.pairs * kPairBytes;
    for (int c = 0; c < NC; ++c) {
      prefetch_weights(w + (kPrefetchChannels + c) * w_stride + whole * kPairBytes, once);
      __m256i wa, wb;
      __m256 d;
      unpack_pair(w + c * w_stride + whole * kPairBytes, dm + c * dm_stride + 2 * whole, wa, wb, d);
      for (int r = 0; r < NT; ++r)
        acc[c][r] = accumulate_odd_pair(wa, wb, xq + r * x.q_stride + whole * 2 * kBlock,
                                        d, xstep + r * x.step_stride + whole * 8, acc[c][r]);
    }
  }
#endif
  // the minimum's term sum_b m * sum(x_block) and the centring's sum_b 7.5 d * sum_error, 8 blocks at a
  // time (the rows' sums are zero-padded to whole groups of 8)
  for (int64_t b8 = 0; b8 < p.nb; b8 += 8) {
    const int64_t count = std::min<int64_t>(8, p.nb - b8);
    for (int c = 0; c < NC; ++c) {
      const uint16_t* d = dm + c * dm_stride + b8;
      const bool last = n0 + c == p.N - 1;  // its m plane ends the tensor
      const __m256 m = load_f16x8(d + p.nb, count, !last);
      const __m256 centre = _mm256_mul_ps(load_f16x8(d, count, p.nb >= 7), _mm256_set1_ps(7.5f));
      for (int r = 0; r < NT; ++r) {
        acc[c][r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(x.sum.data() + (t0 + r) * x.s_stride + b8), acc[c][r]);
        acc[c][r] = _mm256_fmadd_ps(centre, _mm256_loadu_ps(x.sum_error.data() + (t0 + r) * x.s_stride + b8),
                                    acc[c][r]);
      }
    }
  }
  store_tile<NC, NT>(p, acc, n0, t0);
}

// Channels [n_begin, n_end) x rows [t0, t0 + NT) in tiles of NC channels, the last channels one a tile.
template <int NC, int NT>
void stream_channels(const Problem& p, int64_t n_begin, int64_t n_end, int64_t t0, bool once) {
  int64_t n = n_begin;
  for (; n + NC <= n_end; n += NC) tile_stream<NC, NT>(p, n, t0, once);
  if constexpr (NC > 1)
    for (; n < n_end; ++n) tile_stream<1, NT>(p, n, t0, once);
}

// One pass over channels [n_begin, n_end) x rows [t0, t0 + rows), rows <= NT. A pass takes as many channels a
// tile as the accumulators allow (one row 4, as decode ever did; 2 rows 4; 3 rows 2), and 1 from 4 rows (1 x 4
// measured 2-10% faster than 2 x 4).
template <int NT>
void stream_pass(const Problem& p, int64_t n_begin, int64_t n_end, int64_t t0, int64_t rows, bool once) {
  if constexpr (NT > 1)
    if (rows < NT) return stream_pass<NT - 1>(p, n_begin, n_end, t0, rows, once);
  constexpr int kChannels = NT <= 2 ? 4 : NT == 3 ? 2 : 1;
  stream_channels<kChannels, NT>(p, n_begin, n_end, t0, once);
}

// Channels [n_begin, n_end) x rows [t0, t0 + rows), rows <= kStreamRows, in passes of up to kPassRows rows
// (the first streams the weights from memory, the next find them in L1/L2).
void stream_rows(const Problem& p, int64_t n_begin, int64_t n_end, int64_t t0, int64_t rows) {
  const bool once = rows <= kPassRows;
  for (; rows > 0; rows -= kPassRows, t0 += kPassRows)
    stream_pass<kPassRows>(p, n_begin, n_end, t0, std::min<int64_t>(rows, kPassRows), once);
}

// kTileChannels channels unpacked once per work item and reused by all its row tiles (T > 1).
struct UnpackedChannels {
  int64_t w_stride, step_stride, s_stride;
  AlignedVector<int8_t> w;      // [channel, pairs, 64]: interleaved nibbles, laid out as the rows' q
  AlignedVector<float> step;    // [channel, pairs, 8]: (d0, d0, d1, d1) twice
  AlignedVector<float> m;       // [channel, s_stride]: the minima, zero-padded
  AlignedVector<float> centre;  // [channel, s_stride]: 7.5 d, zero-padded

  UnpackedChannels(const Problem& p, int64_t s_stride_)
      : w_stride(padded_pairs(p.pairs) * 2 * kBlock), step_stride(padded_pairs(p.pairs) * 8), s_stride(s_stride_),
        w(kTileChannels * w_stride), step(kTileChannels * step_stride), m(kTileChannels * s_stride),
        centre(kTileChannels * s_stride) {}

  void unpack(const Problem& p, int64_t n0, int channels) {
    for (int c = 0; c < channels; ++c) {
      const uint8_t* qs = p.qs + (n0 + c) * p.pairs * kPairBytes;
      const uint16_t* dm = p.dm + (n0 + c) * 2 * p.nb;
      const int64_t whole = p.pairs / kPairsPerStep * kPairsPerStep;
      for (int64_t j = 0; j < p.pairs; j += kPairsPerStep) {
        StepWeights wt;
        if (j < whole) unpack_step<true>(qs + j * kPairBytes, dm + 2 * j, wt);
        else unpack_step<false>(qs + j * kPairBytes, dm + 2 * j, wt);
        store_step(wt, w.data() + c * w_stride + j * 2 * kBlock, step.data() + c * step_stride + j * 8);
      }
      for (int64_t b = 0; b < p.nb; ++b) {
        m[c * s_stride + b] = _cvtsh_ss(dm[p.nb + b]);
        centre[c * s_stride + b] = 7.5f * _cvtsh_ss(dm[b]);
      }
    }
  }
};

// y for rows [t0, t0 + NT) x the unpacked channels [0, NC) (output channels n0..).
template <int NC, int NT>
void tile_rows(const Problem& p, const UnpackedChannels& u, int64_t n0, int64_t t0) {
  const Int8Rows& x = *p.x;
  Acc sums[NC][NT];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < NT; ++r) sums[c][r] = zero_acc();
  const int8_t* xq = x.q.data() + t0 * x.q_stride;
  const float* xstep = x.step.data() + t0 * x.step_stride;
  const int64_t whole = p.pairs / kPairsPerStep * kPairsPerStep;
  for (int64_t j = 0; j < whole; j += kPairsPerStep) {
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) {
      StepWeights wt;
      load_step(u.w.data() + c * u.w_stride + j * 2 * kBlock, u.step.data() + c * u.step_stride + j * 8, wt);
#pragma GCC unroll 4
      for (int r = 0; r < NT; ++r)
        sums[c][r] = accumulate_step(wt, xq + r * x.q_stride + j * 2 * kBlock, xstep + r * x.step_stride + j * 8,
                                     sums[c][r]);
    }
  }
  __m256 acc[NC][NT];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < NT; ++r) acc[c][r] = fold(sums[c][r]);
#ifdef KILN_Q4_ZMM
  if (whole < p.pairs) {  // the odd last pair, as tile_stream
    for (int c = 0; c < NC; ++c) {
      const int8_t* wq = u.w.data() + c * u.w_stride + whole * 2 * kBlock;
      const __m256i wa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq));
      const __m256i wb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + 2 * kBlock));
      const __m256 d = _mm256_loadu_ps(u.step.data() + c * u.step_stride + whole * 8);
      for (int r = 0; r < NT; ++r)
        acc[c][r] = accumulate_odd_pair(wa, wb, xq + r * x.q_stride + whole * 2 * kBlock, d,
                                        xstep + r * x.step_stride + whole * 8, acc[c][r]);
    }
  }
#endif
  for (int64_t b8 = 0; b8 < p.nb; b8 += 8) {  // the minimum's and the centring's terms, as tile_decode
    for (int c = 0; c < NC; ++c) {
      const __m256 m = _mm256_loadu_ps(u.m.data() + c * u.s_stride + b8);
      const __m256 centre = _mm256_loadu_ps(u.centre.data() + c * u.s_stride + b8);
      for (int r = 0; r < NT; ++r) {
        acc[c][r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(x.sum.data() + (t0 + r) * x.s_stride + b8), acc[c][r]);
        acc[c][r] = _mm256_fmadd_ps(centre, _mm256_loadu_ps(x.sum_error.data() + (t0 + r) * x.s_stride + b8),
                                    acc[c][r]);
      }
    }
  }
  store_tile<NC, NT>(p, acc, n0, t0);
}

// NC unpacked channels x `rows` (< kTileRows) rows: the rows left at the end of a work item.
template <int NC>
void row_edge(const Problem& p, const UnpackedChannels& u, int64_t n0, int64_t t, int64_t rows) {
  static_assert(kTileRows == 4, "row_edge covers up to 3 rows");
  switch (rows) {
    case 3: return tile_rows<NC, 3>(p, u, n0, t);
    case 2: return tile_rows<NC, 2>(p, u, n0, t);
    case 1: return tile_rows<NC, 1>(p, u, n0, t);
    default: return;
  }
}

// Few rows (T <= kStreamRows): tiles straight from the weights (stream_rows). Otherwise, per
// kTileChannels channels: unpack them once, then tiles of kTileRows rows.
void run_item(const Problem& p, int64_t n_begin, int64_t n_end, int64_t t_begin, int64_t t_end) {
  if (t_end - t_begin <= kStreamRows) return stream_rows(p, n_begin, n_end, t_begin, t_end - t_begin);
  static_assert(kTileChannels == 2, "the channel edge below is one channel");
  UnpackedChannels u(p, p.x->s_stride);
  for (int64_t n = n_begin; n < n_end; n += kTileChannels) {
    const bool two = n + 1 < n_end;
    u.unpack(p, n, two ? 2 : 1);
    int64_t t = t_begin;
    for (; t + kTileRows <= t_end; t += kTileRows) two ? tile_rows<2, kTileRows>(p, u, n, t) : tile_rows<1, kTileRows>(p, u, n, t);
    if (t < t_end) two ? row_edge<2>(p, u, n, t, t_end - t) : row_edge<1>(p, u, n, t, t_end - t);
  }
}

struct MatMulQ4_1 {
  MatMulQ4_1(const OrtApi*, const OrtKernelInfo*) {}

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
                      const Ort::Custom::Tensor<uint8_t>& qs, const Ort::Custom::Tensor<Ort::Float16_t>& dm,
                      std::optional<const Ort::Custom::Tensor<float>*> bias, Ort::Custom::Tensor<float>& y) {
    try {
      run(ctx, x, qs, dm, bias.value_or(nullptr), y);
    } catch (const Ort::Exception& e) {
      return Ort::Status(e.what(), e.GetOrtErrorCode());
    } catch (const std::exception& e) {
      return Ort::Status((std::string("kiln.MatMulQ4_1: ") + e.what()).c_str(), ORT_FAIL);
    }
    return Ort::Status{nullptr};
  }

  void run(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x, const Ort::Custom::Tensor<uint8_t>& qs,
           const Ort::Custom::Tensor<Ort::Float16_t>& dm, const Ort::Custom::Tensor<float>* bias,
           Ort::Custom::Tensor<float>& y) const {
    const std::vector<int64_t>& ds = dm.Shape();
    const std::vector<int64_t>& qss = qs.Shape();
    std::vector<int64_t> xs = x.Shape();
    if (ds.size() != 3 || ds[0] <= 0 || ds[1] != 2 || ds[2] <= 0)
      fail_q4("dm must be float16 [N, 2, nb] (rows d and m of each block), got " + shape_text(ds));
    const int64_t N = ds[0], nb = ds[2], K = nb * kBlock, pairs = (nb + 1) / 2;
    if (qss != std::vector<int64_t>{N, pairs, kPairBytes})
      fail_q4("qs must be uint8 [N, ceil(nb / 2), 32] = " + shape_text({N, pairs, kPairBytes}) + " for dm " +
              shape_text(ds) + ", got " + shape_text(qss));
    if (xs.empty() || xs.back() != K)
      fail_q4("x must be [..., K = " + std::to_string(K) + "] for dm " + shape_text(ds) + ", got " + shape_text(xs));
    if (bias != nullptr && bias->Shape() != std::vector<int64_t>{N})
      fail_q4("bias must be [N = " + std::to_string(N) + "], got " + shape_text(bias->Shape()));
    const int64_t T = x.NumberOfElement() / K;
    xs.back() = N;
    Problem p{qs.Data(), reinterpret_cast<const uint16_t*>(dm.Data()), bias ? bias->Data() : nullptr, nullptr,
              y.Allocate(xs), N, nb, pairs};
    if (T == 0) return;

    const int64_t q_stride = padded_pairs(pairs) * 2 * kBlock, step_stride = padded_pairs(pairs) * 8;
    const int64_t s_stride = (nb + 7) / 8 * 8;
    // Decode-sized rows reuse a scratch of the calling thread (four aligned allocations a call measured ~4% of
    // a decode step: docs/design.md, "Where a single-stream step goes"); larger batches allocate their own, so
    // the scratch stays small. `rows` is a reference: the lambdas below run on the pool's threads too.
    thread_local Int8Rows scratch;
    Int8Rows local;
    Int8Rows& rows = T <= kStreamRows ? scratch : local;
    rows.reset(T, q_stride, step_stride, s_stride);
    const float* xd = x.Data();
    auto quantize = [&](size_t t) {
      quantize_row(xd + t * K, nb, rows.q.data() + t * q_stride, rows.step.data() + t * step_stride,
                   rows.sum.data() + t * s_stride, rows.sum_error.data() + t * s_stride);
    };
    if (T * K >= kParallelQuantize) parallel_for_q4(ctx, T, quantize);
    else for (int64_t t = 0; t < T; ++t) quantize(t);
    p.x = &rows;

    const int64_t channel_chunks = (N + kChannelsPerItem - 1) / kChannelsPerItem;
    const int64_t row_chunks = (T + kRowsPerItem - 1) / kRowsPerItem;
    auto item = [&](size_t i) {
      const int64_t c = static_cast<int64_t>(i) % channel_chunks, r = static_cast<int64_t>(i) / channel_chunks;
      run_item(p, c * kChannelsPerItem, std::min(N, (c + 1) * kChannelsPerItem), r * kRowsPerItem,
               std::min(T, (r + 1) * kRowsPerItem));
    };
    parallel_for_q4(ctx, static_cast<size_t>(channel_chunks * row_chunks), item);
  }
};

}  // namespace

void add_matmul_q4_1(Ort::CustomOpDomain& domain) {
  domain.Add(Ort::Custom::CreateLiteCustomOp<MatMulQ4_1>("MatMulQ4_1", "CPUExecutionProvider"));
}

}  // namespace kiln
