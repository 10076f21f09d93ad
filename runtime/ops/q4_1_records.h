// MatMulQ4_1's arithmetic, shared by kiln.MatMulQ4_1 (matmul_q4_1.cc) and kiln.MoE's Q4_1 experts (moe.cc): Q4_1
// weights repacked into records of 16 output channels per block of 32 inputs, activations quantized per block to
// int8 with exact float sums, and the tile that dots them (the semantics: kiln/matmul_q4_1.py).
//
// A record [320 bytes] holds one block of a group of 16 channels: chunk j (64 bytes) has, in lane l's 4 bytes,
// channel l's inputs 8j + i (low nibble) and 8j + 4 + i (high nibble), i = 0..3; then the group's 16 d and 16 m
// in float16. A weight [N, K] is records [ceil(N / 16), K / 32, 320], channels past N zeros (write_block fills
// them from any source layout).
#pragma once

#include <cpuid.h>
#include <immintrin.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include "parallel_for.h"
#include "simd.h"

namespace kiln {
namespace q4_1 {

constexpr int64_t kBlock = 32;
constexpr int64_t kGroup = 16;       // output channels of a packed group
constexpr int64_t kChunkBytes = 64;  // 16 channels x 4 inputs, two inputs a byte
constexpr int64_t kChunks = 4;       // a block's nibbles: inputs 8j..8j+3 (low) and 8j+4..8j+7 (high) in chunk j
constexpr int64_t kStepsOffset = kChunks * kChunkBytes;       // 16 float16 d, then 16 float16 m
constexpr int64_t kRecordBytes = kStepsOffset + 2 * kGroup * 2;  // 320 bytes a (group, block)
constexpr float kCentre = 7.5f;      // the nibbles' mean (see the spec)
// How far ahead a tile prefetches a group's records: 16 blocks, 5 KiB, past the 4 KiB page at which the hardware
// stream prefetcher starts over (as the k-quants' records below). 4 blocks measured 1.15x the 1B shape's
// single-stream step on an Intel Xeon; 32 the same as 16.
constexpr int64_t kPrefetchBlocks = 16;

// std::vector's storage on 64-byte boundaries: a record's chunks are whole cache lines.
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


// Channel `lane` of a group, block b: its 32 nibbles q (input order, values < 16) and float16 bits d, m, written into
// the group's records.
inline void write_block(uint8_t* group_records, int64_t lane, int64_t b, const uint8_t* q, uint16_t d, uint16_t m) {
  uint8_t* rec = group_records + b * kRecordBytes;
  for (int64_t j = 0; j < kChunks; ++j)
    for (int64_t i = 0; i < 4; ++i)
      rec[j * kChunkBytes + 4 * lane + i] = static_cast<uint8_t>(q[8 * j + i] | (q[8 * j + 4 + i] << 4));
  uint16_t* steps = reinterpret_cast<uint16_t*>(rec + kStepsOffset);
  steps[lane] = d;
  steps[kGroup + lane] = m;
}

// The pages wholly inside [p, p + bytes) handed back to the OS (MADV_PAGEOUT: a hint, the memory stays readable).
// ONNX Runtime maps an engine's weights from its data file; once repacked they are never read again, so their clean
// pages would only double what the weights hold in RAM (SmolLM2: 82 MB resident more without this).
inline void release_pages(const void* p, size_t bytes) {
#ifdef MADV_PAGEOUT
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_PAGEOUT);  // refused: nothing lost
#else
  (void)p, (void)bytes;
#endif
}

// ---- activations

// Rows quantized per block of 32: int8 q in input order, and per block the step xs, the exact float sum S and
// c * E (E = S - xs * sum(q): what int8 loses of the sum; c the format's codes' mean, 7.5 for nibbles: the centring
// term of the spec).
struct Int8Rows {
  int64_t K = 0, nb = 0;
  AlignedVector<int8_t> q;  // [T, K]
  AlignedVector<float> step, sum, centred_error;  // [T, nb]
  std::vector<int32_t> sums16;  // [T, K / 16]: the int sums of each 16 q, for the formats that ask (Q6_K's offset)

  void reset(int64_t T, int64_t K_, int64_t nb_, bool with_sums16 = false) {
    K = K_, nb = nb_;
    q.resize(T * K);
    step.resize(T * nb);
    sum.resize(T * nb);
    centred_error.resize(T * nb);
    sums16.resize(with_sums16 ? T * (K / 16) : 0);
  }
};

// sums[i] = the sum of q[16 i .. 16 i + 15], for K / 16 groups
inline void sums_of_16(const int8_t* q, int64_t K, int32_t* sums) {
  for (int64_t g = 0; g < K / 16; ++g) {
    const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * g)));
    __m128i s = _mm_madd_epi16(_mm_add_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)),
                               _mm_set1_epi16(1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    sums[g] = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
  }
}

inline void quantize_row(const float* x, int64_t nb, float centre, int8_t* q, float* steps, float* sums,
                         float* centred_errors) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes packs' lane interleave
  for (int64_t b = 0; b < nb; ++b, x += kBlock, q += kBlock) {
    const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
    const __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
    const __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    const float step = hmax(amax) / 127.f;
    const __m256 inv = _mm256_set1_ps(step > 0.f ? 1.f / step : 0.f);
    const float sum = hsum(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // half to even, as np.rint
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, inv), kRound));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, inv), kRound));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, inv), kRound));
    const __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, inv), kRound));
    const __m256i isum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    steps[b] = step;
    sums[b] = sum;
    centred_errors[b] = centre * (sum - step * hsum(_mm256_cvtepi32_ps(isum)));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, order));
  }
}

// ---- the dot: one vector of output channels (16 in zmm registers, 8 in ymm) against a row
// Records are loaded unaligned: kiln.MatMulQ4_1 reads an engine's records where ONNX Runtime has the tensor (on a page
// boundary when mapped from the engine file, anywhere for a graph input); on aligned data the loads cost the same.

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
// GCC 12's AVX-512 headers make their "undefined" operands with `__Y = __Y`, which -Wall reports at every
// inlined use (GCC bug 105593, fixed in 13): not our code's uninitialized values.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
constexpr int64_t kLanes = 16;
using VI = __m512i;
using VF = __m512;
inline VI load_chunk(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline VI low_nibbles(VI raw) { return _mm512_and_si512(raw, _mm512_set1_epi8(0x0F)); }
inline VI high_nibbles(VI raw) { return _mm512_and_si512(_mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0F)); }
// acc + per lane the dot of its 4 unsigned nibbles with the row's 4 int8 at x. Inline asm for vpdpbusd's embedded
// broadcast ({1to16}: the instruction reads the 4 bytes itself): GCC 12 emitted a vpbroadcastd before every
// vpdpbusd for _mm512_set1_epi32, twice the many-row tile's inner-loop instructions (a Q4_K_M 1B prefill chunk of
// 256: 0.96x the time).
inline VI dot4(VI acc, VI w, const int8_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}
// A block's dots as int32 per lane (dot4 already sums into int32 here).
inline VI block_sums(VI dots) { return dots; }
// acc32 + per lane the dot of 8 codes below 64 (lo: the row's 4 int8 at x, hi: the 4 at x + 4), in int32
inline VI dot8_32(VI acc32, VI lo, VI hi, const int8_t* x) { return dot4(dot4(acc32, lo, x), hi, x + 4); }
inline VI zero_i() { return _mm512_setzero_si512(); }
inline VF zero_f() { return _mm512_setzero_ps(); }
inline VF to_float(VI v) { return _mm512_cvtepi32_ps(v); }
inline VF fmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline VF load_f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// a lane's unsigned / signed byte at p + lane, as float
inline VF load_u8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline VF load_i8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF negate(VF a) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN)));
}
inline VI sub_i(VI a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
inline VI add_i(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VI or_i(VI a, VI b) { return _mm512_or_si512(a, b); }
// per byte of h: its 2 bits at 4 - shift moved to bits 4..5, the rest 0 (16-bit shifts: the mask drops what
// crossed from the neighbouring byte)
inline VI high_bits(VI h, int shift) {
  const VI moved = shift >= 0 ? _mm512_slli_epi16(h, static_cast<unsigned>(shift))
                              : _mm512_srli_epi16(h, static_cast<unsigned>(-shift));
  return _mm512_and_si512(moved, _mm512_set1_epi8(0x30));
}
// per byte of h: its bit at 4 - shift moved to bit 4, the rest 0 (Q5_K's fifth bits; as high_bits)
inline VI fifth_bits(VI h, int shift) {
  const VI moved = shift >= 0 ? _mm512_slli_epi16(h, static_cast<unsigned>(shift))
                              : _mm512_srli_epi16(h, static_cast<unsigned>(-shift));
  return _mm512_and_si512(moved, _mm512_set1_epi8(0x10));
}
inline void store_lanes(float* y, VF v, int64_t count) {
  if (count >= kLanes) _mm512_storeu_ps(y, v);
  else _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << count) - 1), v);
}
inline VF load_lanes(const float* p, int64_t count) {
  if (count >= kLanes) return _mm512_loadu_ps(p);
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1), p);
}
#else
constexpr int64_t kLanes = 8;
using VI = __m256i;
using VF = __m256;
inline VI load_chunk(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VI low_nibbles(VI raw) { return _mm256_and_si256(raw, _mm256_set1_epi8(0x0F)); }
inline VI high_nibbles(VI raw) { return _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F)); }
// Without vpdpbusd a block's dot stays in int16 pairs (maddubs) until block_sums folds them: a pair is at most
// 2 * 15 * 127 = 3810 and a block sums 8 of them per lane, 30480 < 2^15, so nothing saturates or wraps and the
// int32 sums are vpdpbusd's.
inline VI zero_i() { return _mm256_setzero_si256(); }
inline VI dot4(VI acc, VI w, const int8_t* x) {
  int32_t x4;
  std::memcpy(&x4, x, 4);
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, _mm256_set1_epi32(x4)));
}
inline VI block_sums(VI dots) { return _mm256_madd_epi16(dots, _mm256_set1_epi16(1)); }
// 6-bit codes: a pair is up to 2 * 63 * 127 = 16002, so two pairs (one chunk's lo and hi) are all int16 holds
// before they are folded into int32.
inline VI dot8_32(VI acc32, VI lo, VI hi, const int8_t* x) {
  return _mm256_add_epi32(acc32, block_sums(dot4(dot4(zero_i(), lo, x), hi, x + 4)));
}
inline VF zero_f() { return _mm256_setzero_ps(); }
inline VF to_float(VI v) { return _mm256_cvtepi32_ps(v); }
inline VF fmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline VF load_f16(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VF load_u8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline VF load_i8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF negate(VF a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.f)); }
inline VI sub_i(VI a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
inline VI add_i(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VI or_i(VI a, VI b) { return _mm256_or_si256(a, b); }
inline VI high_bits(VI h, int shift) {  // as the AVX-512 one
  const VI moved = shift >= 0 ? _mm256_slli_epi16(h, shift) : _mm256_srli_epi16(h, -shift);
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x30));
}
inline VI fifth_bits(VI h, int shift) {  // as the AVX-512 one
  const VI moved = shift >= 0 ? _mm256_slli_epi16(h, shift) : _mm256_srli_epi16(h, -shift);
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}
inline void store_lanes(float* y, VF v, int64_t count) {
  if (count >= kLanes) return _mm256_storeu_ps(y, v);
  alignas(32) float tmp[kLanes];
  _mm256_store_ps(tmp, v);
  std::memcpy(y, tmp, static_cast<size_t>(count) * sizeof(float));
}
inline VF load_lanes(const float* p, int64_t count) {
  if (count >= kLanes) return _mm256_loadu_ps(p);
  alignas(32) float tmp[kLanes] = {};
  std::memcpy(tmp, p, static_cast<size_t>(count) * sizeof(float));
  return _mm256_load_ps(tmp);
}
#endif
constexpr int64_t kVectorsPerGroup = kGroup / kLanes;

struct Problem {
  const uint8_t* w;    // the records [groups, nb, 320]
  const float* bias;   // [N] or nullptr
  const Int8Rows* x;
  float* y;            // [T, N]
  int64_t N, nb, group_bytes;
};

// Whether weights read once are prefetched non-temporally on this CPU: on AMD's (a single-stream SmolLM2 step
// 0.92-0.94x of T0's on Zen 4), not elsewhere. Intel's server cores fill a prefetchnta line into L1 alone, past L2:
// on a Xeon (Emerald Rapids) the step took 2.3x T0's on SmolLM2, whose weights T0 keeps in the 300 MB L3, and 1.46x
// on the 1B shape, whose weights do not fit it.
inline bool non_temporal_weights() {
  static const bool amd = [] {
    unsigned eax = 0, vendor[3] = {};
    __cpuid(0, eax, vendor[0], vendor[2], vendor[1]);  // the vendor string is EBX, EDX, ECX
    return std::memcmp(vendor, "AuthenticAMD", 12) == 0;
  }();
  return amd;
}

// A weight prefetch that a call reads once (its rows fit one pass) is non-temporal where the format says so (Q4_1,
// the k-quants; Q8_0 measured the other way) and the CPU gains by it (non_temporal_weights): the weights, ~60 MB a
// decode step, would otherwise evict from L2 and L3 what the rest of the step reads next (docs/design.md,
// "kiln.MatMulQ4_1"). With more passes the later ones re-read the group from the caches, so those prefetches keep
// it. Always inlined: GCC takes a function that only prefetches for one without effects and drops its calls.
template <int64_t Bytes = kRecordBytes>
__attribute__((always_inline)) inline void prefetch_record(const uint8_t* p, bool non_temporal) {
  for (int64_t line = 0; line < Bytes; line += 64) {
    if (non_temporal) _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_NTA);
    else _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
  }
}

// A block of 32 inputs x one vector of channels against NT rows: each chunk unpacked once for the rows, their int32
// dots in registers, then per row acc += d (xs dot + 7.5 E) + m S (the spec's terms, in this order).
template <int NT>
__attribute__((always_inline)) inline void q4_1_block(const uint8_t* nibbles, VF d, VF m, const Int8Rows& x,
                                                      const int8_t* const* xq, int64_t t0, int64_t b,
                                                      int64_t lane_bytes, VF* acc) {
  VI dots[NT];
  for (int r = 0; r < NT; ++r) dots[r] = zero_i();
#pragma GCC unroll 4
  for (int64_t j = 0; j < kChunks; ++j) {
    const VI raw = load_chunk(nibbles + j * kChunkBytes + lane_bytes * 4);
    const VI lo = low_nibbles(raw), hi = high_nibbles(raw);
#pragma GCC unroll 16
    for (int r = 0; r < NT; ++r) {
      const int8_t* xb = xq[r] + b * kBlock + 8 * j;
      dots[r] = dot4(dot4(dots[r], lo, xb), hi, xb + 4);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < NT; ++r) {
    const int64_t i = (t0 + r) * x.nb + b;
    const VF scaled = fmadd(to_float(block_sums(dots[r])), broadcast(&x.step[i]), broadcast(&x.centred_error[i]));
    acc[r] = fmadd(m, broadcast(&x.sum[i]), fmadd(d, scaled, acc[r]));
  }
}

// Rows a pass (a format's kPassRows): as many as the registers hold (32 zmm in the VNNI build, 16 ymm in AVX2's)
// with the weights' chunk, its two nibble halves and d, m. Decode is a pass of one row: tiles of several vectors
// for one row (more independent vpdpbusd chains) measured slower on cold weights, 1.2-1.5x a call. The k-quants'
// blocks make their steps and minimums from the record's bytes (more registers live): at 12 rows GCC spilled
// accumulators in every block, and 11 measured 0.97x a Q4_K_M (Q4_K and Q6_K) prefill chunk's time, 0.96x Q5_K_M's;
// Q8_0's and Q4_1's keep 12.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
constexpr int kPassRows = 12;
constexpr int kKQuantPassRows = 11;
#else
constexpr int kPassRows = 6;
constexpr int kKQuantPassRows = 6;
#endif

// A record format: kBlocksPerRecord blocks of 32 inputs a record of kRecordBytes, for a group of 16 channels;
// `block<NT>` adds block s of a record into the NT rows' accumulators. Q4_1's records are one block each, their d
// and m float16 lanes (q4_k_records.h and q6_k_records.h: GGUF's k-quants, a superblock a record).
struct Q4_1Format {
  static constexpr int64_t kBlocksPerRecord = 1;
  static constexpr int64_t kRecordBytes = q4_1::kRecordBytes;
  static constexpr int kPassRows = q4_1::kPassRows;
  static constexpr int64_t kPrefetchBytes = kRecordBytes;  // a tile's prefetch a block: its record
  static constexpr bool kNonTemporalOnce = true;  // a call reading its records once prefetches them non-temporally
  static constexpr bool kSums16 = false;
  static constexpr float kCentre = q4_1::kCentre;
  struct RecordSteps {};
  static RecordSteps record_steps(const uint8_t*, int64_t) { return {}; }
  // the bytes a tile prefetches, kPrefetchBlocks blocks ahead of block s
  static const uint8_t* ahead(const uint8_t* record, int64_t) { return record + kPrefetchBlocks * kRecordBytes; }
  template <int NT>
  static void block(const uint8_t* record, int64_t, const RecordSteps&, int64_t lane_bytes, const Int8Rows& x,
                    const int8_t* const* xq, int64_t t0, int64_t b, VF* acc) {
    const uint8_t* steps = record + kStepsOffset + lane_bytes * 2;
    q4_1_block<NT>(record, load_f16(steps), load_f16(steps + kGroup * 2), x, xq, t0, b, lane_bytes, acc);
  }
};

// What GGUF's k-quant formats (q4_k_records.h, q6_k_records.h) share: a record is a 256-input superblock, 8
// blocks of 32, whose bytes are spread evenly over its blocks for the prefetch, which looks 16 blocks (about a
// page) ahead: decode streams each record once and the hardware prefetcher restarts at every 4 KiB page; 4 records
// ahead measured 0.75-0.8x the decode rate on the 3B shape (Zen 3).
constexpr int64_t kSuperblockBlocks = 8;

template <int64_t RecordBytes>
struct SuperblockRecord {
  static constexpr int64_t kBlocksPerRecord = kSuperblockBlocks;
  static constexpr int64_t kRecordBytes = RecordBytes;
  static constexpr int kPassRows = kKQuantPassRows;
  static constexpr float kCentre = q4_1::kCentre;  // the codes' mean, whose multiple of E Int8Rows holds
  static constexpr int64_t kPrefetchBlocks = 16;
  // a tile's prefetch a block: 5 lines, the Q4_1 record's (Q4_K's block share, 296 bytes; Q6_K's 424 are left to
  // the hardware prefetcher's share as measured); formats with more a block say so
  static constexpr int64_t kPrefetchBytes = q4_1::kRecordBytes;
  static constexpr bool kNonTemporalOnce = true;
  static_assert(kRecordBytes % 64 == 0, "a record is whole cache lines");
  static const uint8_t* ahead(const uint8_t* record, int64_t s) {
    return record + (s + kPrefetchBlocks) * (kRecordBytes / kBlocksPerRecord);
  }
};

// y for one vector of output channels (vector v: kLanes channels from v * kLanes) x NT rows from t0, over every
// block: block by block into the rows' float32 accumulators (NT = 12 in zmm: 24 accumulators; rows of a call
// beyond one pass re-read the group from L1). A row's operations are the same for every NT, so its outputs are
// bitwise the same whatever the rows beside it.
template <class Format, int NT>
__attribute__((noinline)) inline void tile(const Problem& p, int64_t v, int64_t t0, bool non_temporal) {
  const Int8Rows& x = *p.x;
  const int64_t lane_bytes = (v % kVectorsPerGroup) * kLanes;  // the vector's lanes within its group's records
  const uint8_t* records = p.w + (v / kVectorsPerGroup) * p.group_bytes;
  const int8_t* xq[NT];
  for (int r = 0; r < NT; ++r) xq[r] = x.q.data() + (t0 + r) * x.K;
  VF acc[NT];
  for (int r = 0; r < NT; ++r) acc[r] = zero_f();

  for (int64_t rb = 0; rb < p.nb / Format::kBlocksPerRecord; ++rb) {
    const uint8_t* record = records + rb * Format::kRecordBytes;
    const typename Format::RecordSteps record_steps = Format::record_steps(record, lane_bytes);
    for (int64_t s = 0; s < Format::kBlocksPerRecord; ++s) {
      prefetch_record<Format::kPrefetchBytes>(Format::ahead(record, s), non_temporal);
      Format::template block<NT>(record, s, record_steps, lane_bytes, x, xq, t0, rb * Format::kBlocksPerRecord + s,
                                 acc);
    }
  }

  const int64_t n = v * kLanes, count = std::min<int64_t>(kLanes, p.N - n);
  if (count <= 0) return;  // an AVX2 vector of padding channels
  const VF bias = p.bias ? load_lanes(p.bias + n, count) : zero_f();
  for (int r = 0; r < NT; ++r) store_lanes(p.y + (t0 + r) * p.N + n, p.bias ? acc[r] + bias : acc[r], count);
}

template <class Format, int NT>
inline void pass_rows(const Problem& p, int64_t v, int64_t t0, int64_t rows, bool non_temporal) {
  if constexpr (NT > 1)
    if (rows < NT) return pass_rows<Format, NT - 1>(p, v, t0, rows, non_temporal);
  tile<Format, NT>(p, v, t0, non_temporal);
}

// Channel vectors [v_begin, v_end) x rows [t_begin, t_end), a vector's passes one after the other (its records
// then come from L1).
template <class Format = Q4_1Format>
inline void run_item(const Problem& p, int64_t v_begin, int64_t v_end, int64_t t_begin, int64_t t_end) {
  constexpr int kRows = Format::kPassRows;
  const bool once = t_end - t_begin <= kRows;  // the rows fit one pass: nothing reads the records again
  const bool non_temporal = once && Format::kNonTemporalOnce && non_temporal_weights();
  for (int64_t v = v_begin; v < v_end; ++v)
    for (int64_t t = t_begin; t < t_end; t += kRows)
      pass_rows<Format, kRows>(p, v, t, std::min<int64_t>(kRows, t_end - t), non_temporal);
}

constexpr int64_t kGroupsPerItem = 2;   // channel groups per work item (SmolLM2's N = 576 is 36 groups)
constexpr int64_t kRowsPerItem = 32;    // activation rows per work item
constexpr int64_t kParallelQuantize = 1 << 15;  // activation elements from which quantizing is parallel

// out = rows row(0) .. row(T - 1) (each K floats) quantized per block of 32, with their 16-sums when asked and
// centre * E; rows in parallel where there are many values.
template <class RowFn>
void quantize_rows(OrtKernelContext* ctx, int64_t T, int64_t K, bool with_sums16, float centre, RowFn&& row,
                   Int8Rows& out) {
  const int64_t nb = K / kBlock;
  out.reset(T, K, nb, with_sums16);
  auto quantize = [&](size_t t) {
    quantize_row(row(t), nb, centre, out.q.data() + t * K, out.step.data() + t * nb, out.sum.data() + t * nb,
                 out.centred_error.data() + t * nb);
    if (with_sums16) sums_of_16(out.q.data() + t * K, K, out.sums16.data() + t * (K / 16));
  };
  if (T * K >= kParallelQuantize) parallel_for(ctx, T, quantize);
  else for (int64_t t = 0; t < T; ++t) quantize(t);
}

// dst's row i = src's row index[i] (quantized rows copied, not quantized again).
inline void gather_rows(const Int8Rows& src, const std::vector<int64_t>& index, Int8Rows& dst) {
  const int64_t n = static_cast<int64_t>(index.size()), K = src.K, nb = src.nb, s16 = src.sums16.empty() ? 0 : K / 16;
  dst.reset(n, K, nb, s16 != 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = index[i];
    std::memcpy(dst.q.data() + i * K, src.q.data() + t * K, K);
    std::copy_n(src.step.data() + t * nb, nb, dst.step.data() + i * nb);
    std::copy_n(src.sum.data() + t * nb, nb, dst.sum.data() + i * nb);
    std::copy_n(src.centred_error.data() + t * nb, nb, dst.centred_error.data() + i * nb);
    std::copy_n(src.sums16.data() + t * s16, s16, dst.sums16.data() + i * s16);
  }
}

// y [T, N] = the op's x [T, K] times records w (groups of `group_bytes` each) in `Format`: the rows quantized per
// block of 32 (with `centre` times E: the format's codes' mean, or the op's centre attribute), then work items of
// channel groups x rows on ONNX Runtime's intra-op threads.
template <class Format>
void multiply(OrtKernelContext* ctx, const uint8_t* w, int64_t group_bytes, const float* x, const float* bias,
              float* y, int64_t T, int64_t N, int64_t K, float centre = Format::kCentre) {
  thread_local Int8Rows scratch;  // decode-sized rows reuse the calling thread's; larger batches allocate their own
  Int8Rows local;
  Int8Rows& rows = T <= kRowsPerItem ? scratch : local;
  quantize_rows(ctx, T, K, Format::kSums16, centre, [&](size_t t) { return x + t * K; }, rows);

  const Problem p{w, bias, &rows, y, N, K / kBlock, group_bytes};
  const int64_t vectors = (N + kGroup - 1) / kGroup * kVectorsPerGroup;
  const int64_t vectors_per_item = kGroupsPerItem * kVectorsPerGroup;
  const int64_t channel_chunks = (vectors + vectors_per_item - 1) / vectors_per_item;
  const int64_t row_chunks = (T + kRowsPerItem - 1) / kRowsPerItem;
  auto item = [&](size_t i) {
    const int64_t c = static_cast<int64_t>(i) % channel_chunks, r = static_cast<int64_t>(i) / channel_chunks;
    run_item<Format>(p, c * vectors_per_item, std::min(vectors, (c + 1) * vectors_per_item), r * kRowsPerItem,
                     std::min(T, (r + 1) * kRowsPerItem));
  };
  parallel_for(ctx, static_cast<size_t>(channel_chunks * row_chunks), item);
}

}  // namespace q4_1
}  // namespace kiln
