// kiln.MatMulQ4_1 (domain "kiln", version 1): the ONNX Runtime CPU kernel.
//
// The contract (inputs, weight layout, semantics) is written once, with its numpy reference
// implementation, in kiln/matmul_q4_1.py; this file implements it.
//
//   1. at session load, the constant weights are repacked once for this kernel (pack_weights): output
//      channels in groups of 16, each block of 32 inputs of a group one 320-byte record (the group's
//      nibbles four inputs a lane, then its 16 d and 16 m in float16). Weights that are not constant are
//      repacked on every call;
//   2. each activation row is quantized per block of 32 to int8 (step max|x| / 127, exact float sum and
//      what int8 loses of it);
//   3. work items (a chunk of channel groups x a chunk of rows) run on ONNX Runtime's intra-op thread pool;
//      a tile is one vector of channels x up to 12 rows. Lanes are output channels: a block's dot is 8 vpdpbusd
//      (16 channels x 4 inputs each, the row's 4 int8 broadcast) into int32, then scaled once per block:
//          y += d * (xs * dot + 7.5 * E) + m * S
//      A tile's accumulators are its outputs, so nothing is summed across lanes at the end.
//
// Output channels in lanes make the per-block float work one conversion and three FMAs per 16 channels and
// row, where inputs in lanes paid it per 8 inputs (docs/design.md, "kiln.MatMulQ4_1"). Every path
// sums a (channel, row) over the blocks in order with the same arithmetic, so a row's outputs are bitwise the same
// for every T and every tile (speculative verification reproduces decode's logits exactly), and the AVX2 build,
// which emulates vpdpbusd with maddubs + madd (the same int32 sums: a nibble times |x| <= 127, twice, fits
// int16), computes the same bits.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <immintrin.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "matmul_q4_1.h"
#include "parallel_for.h"
#include "shape_text.h"
#include "simd.h"

namespace kiln {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPairBytes = 32;   // the op's qs: the nibbles of two blocks
constexpr int64_t kGroup = 16;       // output channels of a packed group
constexpr int64_t kChunkBytes = 64;  // 16 channels x 4 inputs, two inputs a byte
constexpr int64_t kChunks = 4;       // a block's nibbles: inputs 8j..8j+3 (low) and 8j+4..8j+7 (high) in chunk j
constexpr int64_t kStepsOffset = kChunks * kChunkBytes;       // 16 float16 d, then 16 float16 m
constexpr int64_t kRecordBytes = kStepsOffset + 2 * kGroup * 2;  // 320 bytes a (group, block)
constexpr float kCentre = 7.5f;      // the nibbles' mean (see the spec)
constexpr int64_t kGroupsPerItem = 2;   // channel groups per work item (SmolLM2's N = 576 is 36 groups)
constexpr int64_t kRowsPerItem = 32;    // activation rows per work item
constexpr int64_t kPrefetchBlocks = 4;  // how far ahead a tile prefetches a group's records
constexpr int64_t kParallelQuantize = 1 << 15;  // activation elements from which quantizing is parallel

[[noreturn]] void fail_q4(const std::string& msg) {
  throw Ort::Exception("kiln.MatMulQ4_1: " + msg, ORT_INVALID_ARGUMENT);
}

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

// ---- the weights, repacked

struct Shape {
  int64_t N = 0, nb = 0;
  int64_t groups() const { return (N + kGroup - 1) / kGroup; }
  int64_t group_bytes() const { return nb * kRecordBytes; }
};

// Packed records: 64-byte aligned (a record's chunks are whole cache lines), left uninitialised (pack_groups writes
// every byte). Buffers of 2 MiB and more are 2 MiB aligned and asked for huge pages: an 8B model's 4.5 GB of records
// faulted in 4 KiB pages cost its load ~1 s of page faults alone.
class PackedWeights {
 public:
  PackedWeights() = default;
  explicit PackedWeights(size_t size) {
    data_ = static_cast<uint8_t*>(::operator new(size, std::align_val_t(alignment(size))));
    size_ = size;
#ifdef MADV_HUGEPAGE
    if (alignment(size) == kHugePage) madvise(data_, size / kHugePage * kHugePage, MADV_HUGEPAGE);  // a hint
#endif
  }
  PackedWeights(PackedWeights&& other) noexcept { swap(other); }
  PackedWeights& operator=(PackedWeights&& other) noexcept {
    swap(other);
    return *this;
  }
  PackedWeights(const PackedWeights&) = delete;
  PackedWeights& operator=(const PackedWeights&) = delete;
  ~PackedWeights() {
    if (data_) ::operator delete(data_, std::align_val_t(alignment(size_)));
  }
  bool empty() const { return data_ == nullptr; }
  uint8_t* data() const { return data_; }

 private:
  static constexpr size_t kHugePage = size_t{1} << 21;
  static size_t alignment(size_t size) { return size >= kHugePage ? kHugePage : 64; }
  void swap(PackedWeights& other) {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
  }
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Channel n's block b (its 32 nibbles, the low or high halves of the op's 32-byte pair) as the 16 bytes of its lane:
// byte 4j + i = nibble 8j + i | nibble 8j + 4 + i << 4.
inline __m128i lane_bytes(const uint8_t* pair, int shift) {
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i v0 = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair)),
                                                 _mm_cvtsi32_si128(shift)), mask);
  const __m128i v1 = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + 16)),
                                                 _mm_cvtsi32_si128(shift)), mask);
  const __m128i lo = _mm_or_si128(
      _mm_shuffle_epi8(v0, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, -1, -1, -1, -1, -1, -1, -1, -1)),
      _mm_shuffle_epi8(v1, _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 2, 3, 8, 9, 10, 11)));
  const __m128i hi = _mm_or_si128(
      _mm_shuffle_epi8(v0, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)),
      _mm_shuffle_epi8(v1, _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 4, 5, 6, 7, 12, 13, 14, 15)));
  return _mm_or_si128(lo, _mm_slli_epi16(hi, 4));  // hi's bytes are < 16: nothing shifts across a byte
}

// The records of channel groups [g_begin, g_end), each written whole and in order; channels past N are zeros.
void pack_groups(const uint8_t* qs, const uint16_t* dm, const Shape& s, uint8_t* out, int64_t g_begin,
                 int64_t g_end) {
  const int64_t pairs = (s.nb + 1) / 2;
  for (int64_t g = g_begin; g < g_end; ++g)
    for (int64_t b = 0; b < s.nb; ++b) {
      uint8_t* rec = out + g * s.group_bytes() + b * kRecordBytes;
      uint16_t* steps = reinterpret_cast<uint16_t*>(rec + kStepsOffset);
      const int shift = 4 * static_cast<int>(b % 2);
      for (int64_t l = 0; l < kGroup; ++l) {
        const int64_t n = g * kGroup + l;
        const __m128i lane = n < s.N ? lane_bytes(qs + (n * pairs + b / 2) * kPairBytes, shift) : _mm_setzero_si128();
        for (int j = 0; j < kChunks; ++j) {
          const int32_t word = j == 0 ? _mm_extract_epi32(lane, 0) : j == 1 ? _mm_extract_epi32(lane, 1)
                               : j == 2 ? _mm_extract_epi32(lane, 2) : _mm_extract_epi32(lane, 3);
          std::memcpy(rec + j * kChunkBytes + 4 * l, &word, 4);
        }
        steps[l] = n < s.N ? dm[n * 2 * s.nb + b] : 0;
        steps[kGroup + l] = n < s.N ? dm[(n * 2 + 1) * s.nb + b] : 0;
      }
    }
}

// The op's qs [N, ceil(nb / 2), 32] and dm [N, 2, nb] as records [groups, nb, 320]: chunk j of block b holds, in
// lane l's 4 bytes, channel 16g + l's inputs 32b + 8j + i (low nibble) and 32b + 8j + 4 + i (high nibble), i = 0..3;
// then the group's 16 d and 16 m. Channels past N are zeros. A large matrix is packed on one thread per core (the
// session's load waits on it: an 8B model's 4.5 GB took ~4 s on one thread).
PackedWeights pack_weights(const uint8_t* qs, const uint16_t* dm, const Shape& s) {
  PackedWeights out(static_cast<size_t>(s.groups() * s.group_bytes()));
  constexpr int64_t kBytesPerThread = int64_t{8} << 20;
  const int64_t threads = std::min<int64_t>({std::max(1u, std::thread::hardware_concurrency()), s.groups(),
                                             std::max<int64_t>(1, s.groups() * s.group_bytes() / kBytesPerThread)});
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < threads; ++t)
    workers.emplace_back(pack_groups, qs, dm, std::cref(s), out.data(), s.groups() * t / threads,
                         s.groups() * (t + 1) / threads);
  pack_groups(qs, dm, s, out.data(), 0, s.groups() / threads);
  for (std::thread& worker : workers) worker.join();
  return out;
}

// The pages wholly inside [p, p + bytes) handed back to the OS (MADV_PAGEOUT: a hint, the memory stays readable).
// ONNX Runtime maps an engine's weights from its data file; once repacked they are never read again, so their clean
// pages would only double what the weights hold in RAM (SmolLM2: 82 MB resident more without this).
void release_pages(const void* p, size_t bytes) {
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
// 7.5 * E (E = S - xs * sum(q): what int8 loses of the sum; the centring term of the spec).
struct Int8Rows {
  int64_t K = 0, nb = 0;
  AlignedVector<int8_t> q;  // [T, K]
  AlignedVector<float> step, sum, centred_error;  // [T, nb]

  void reset(int64_t T, int64_t K_, int64_t nb_) {
    K = K_, nb = nb_;
    q.resize(T * K);
    step.resize(T * nb);
    sum.resize(T * nb);
    centred_error.resize(T * nb);
  }
};

void quantize_row(const float* x, int64_t nb, int8_t* q, float* steps, float* sums, float* centred_errors) {
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
    centred_errors[b] = kCentre * (sum - step * hsum(_mm256_cvtepi32_ps(isum)));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, order));
  }
}

// ---- the dot: one vector of output channels (16 in zmm registers, 8 in ymm) against a row

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
// GCC 12's AVX-512 headers make their "undefined" operands with `__Y = __Y`, which -Wall reports at every
// inlined use (GCC bug 105593, fixed in 13): not our code's uninitialized values.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
constexpr int64_t kLanes = 16;
using VI = __m512i;
using VF = __m512;
inline VI load_chunk(const uint8_t* p) { return _mm512_load_si512(p); }
inline VI low_nibbles(VI raw) { return _mm512_and_si512(raw, _mm512_set1_epi8(0x0F)); }
inline VI high_nibbles(VI raw) { return _mm512_and_si512(_mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0F)); }
// acc + per lane the dot of its 4 unsigned nibbles with the row's 4 int8 at x
inline VI dot4(VI acc, VI w, const int8_t* x) {
  int32_t x4;
  std::memcpy(&x4, x, 4);
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4));
}
// A block's dots as int32 per lane (dot4 already sums into int32 here).
inline VI block_sums(VI dots) { return dots; }
inline VI zero_i() { return _mm512_setzero_si512(); }
inline VF zero_f() { return _mm512_setzero_ps(); }
inline VF to_float(VI v) { return _mm512_cvtepi32_ps(v); }
inline VF fmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline VF load_f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(p))); }
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
inline VI load_chunk(const uint8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
inline VI low_nibbles(VI raw) { return _mm256_and_si256(raw, _mm256_set1_epi8(0x0F)); }
inline VI high_nibbles(VI raw) { return _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F)); }
// Without vpdpbusd a block's dot stays in int16 pairs (maddubs) until block_sums folds them: a pair is at most
// 2 * 15 * 127 = 3810 and a block sums 8 of them per lane, 30480 < 2^15, so nothing saturates or wraps and the
// int32 sums are vpdpbusd's.
inline VI dot4(VI acc, VI w, const int8_t* x) {
  int32_t x4;
  std::memcpy(&x4, x, 4);
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, _mm256_set1_epi32(x4)));
}
inline VI block_sums(VI dots) { return _mm256_madd_epi16(dots, _mm256_set1_epi16(1)); }
inline VI zero_i() { return _mm256_setzero_si256(); }
inline VF zero_f() { return _mm256_setzero_ps(); }
inline VF to_float(VI v) { return _mm256_cvtepi32_ps(v); }
inline VF fmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline VF load_f16(const uint8_t* p) { return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(p))); }
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

// A weight prefetch that a call reads once (its rows fit one pass) is non-temporal: the weights, ~60 MB a decode
// step, would otherwise evict from L2 and L3 what the rest of the step reads next (docs/design.md, "kiln.MatMulQ4_1").
// With more passes the later ones re-read the group from the caches, so those prefetches keep it. Always inlined:
// GCC takes a function that only prefetches for one without effects and drops its calls.
__attribute__((always_inline)) inline void prefetch_record(const uint8_t* p, bool once) {
  for (int64_t line = 0; line < kRecordBytes; line += 64) {
    if (once) _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_NTA);
    else _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
  }
}

// y for one vector of output channels (vector v: kLanes channels from v * kLanes) x NT rows from t0, over every
// block. Each chunk of the weights is unpacked once for the NT rows; their int32 dots and float sums stay in
// registers (NT = 12 in zmm: 24 accumulators; rows of a call beyond one pass re-read the group from L1).
template <int NT>
__attribute__((noinline)) void tile(const Problem& p, int64_t v, int64_t t0, bool once) {
  const Int8Rows& x = *p.x;
  const int64_t lane_bytes = (v % kVectorsPerGroup) * kLanes;  // the vector's lanes within its group's records
  const uint8_t* records = p.w + (v / kVectorsPerGroup) * p.group_bytes;
  const int8_t* xq[NT];
  for (int r = 0; r < NT; ++r) xq[r] = x.q.data() + (t0 + r) * x.K;
  VF acc[NT];
  for (int r = 0; r < NT; ++r) acc[r] = zero_f();

  for (int64_t b = 0; b < p.nb; ++b) {
    const uint8_t* record = records + b * kRecordBytes;
    prefetch_record(record + kPrefetchBlocks * kRecordBytes, once);
    VI dots[NT];
    for (int r = 0; r < NT; ++r) dots[r] = zero_i();
#pragma GCC unroll 4
    for (int64_t j = 0; j < kChunks; ++j) {
      const VI raw = load_chunk(record + j * kChunkBytes + lane_bytes * 4);
      const VI lo = low_nibbles(raw), hi = high_nibbles(raw);
#pragma GCC unroll 16
      for (int r = 0; r < NT; ++r) {
        const int8_t* xb = xq[r] + b * kBlock + 8 * j;
        dots[r] = dot4(dot4(dots[r], lo, xb), hi, xb + 4);
      }
    }
    const uint8_t* steps = record + kStepsOffset + lane_bytes * 2;
    const VF d = load_f16(steps), m = load_f16(steps + kGroup * 2);
#pragma GCC unroll 16
    for (int r = 0; r < NT; ++r) {
      const int64_t i = (t0 + r) * x.nb + b;
      const VF scaled = fmadd(to_float(block_sums(dots[r])), broadcast(&x.step[i]), broadcast(&x.centred_error[i]));
      acc[r] = fmadd(m, broadcast(&x.sum[i]), fmadd(d, scaled, acc[r]));
    }
  }

  const int64_t n = v * kLanes, count = std::min<int64_t>(kLanes, p.N - n);
  if (count <= 0) return;  // an AVX2 vector of padding channels
  const VF bias = p.bias ? load_lanes(p.bias + n, count) : zero_f();
  for (int r = 0; r < NT; ++r) store_lanes(p.y + (t0 + r) * p.N + n, p.bias ? acc[r] + bias : acc[r], count);
}

// Rows a pass: as many as the registers hold (32 zmm in the VNNI build, 16 ymm in AVX2's) with the weights' chunk,
// its two nibble halves and d, m. Decode is a pass of one row: tiles of several vectors for one row (more
// independent vpdpbusd chains) measured slower on cold weights, 1.2-1.5x a call.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
constexpr int kPassRows = 12;
#else
constexpr int kPassRows = 6;
#endif

template <int NT>
void pass_rows(const Problem& p, int64_t v, int64_t t0, int64_t rows, bool once) {
  if constexpr (NT > 1)
    if (rows < NT) return pass_rows<NT - 1>(p, v, t0, rows, once);
  tile<NT>(p, v, t0, once);
}

// Channel vectors [v_begin, v_end) x rows [t_begin, t_end), a vector's passes one after the other (its records
// then come from L1).
void run_item(const Problem& p, int64_t v_begin, int64_t v_end, int64_t t_begin, int64_t t_end) {
  const bool once = t_end - t_begin <= kPassRows;
  for (int64_t v = v_begin; v < v_end; ++v)
    for (int64_t t = t_begin; t < t_end; t += kPassRows)
      pass_rows<kPassRows>(p, v, t, std::min<int64_t>(kPassRows, t_end - t), once);
}

// The op's contract on its weights' shapes (kiln/matmul_q4_1.py), for the constructor and for Compute's errors.
bool valid_dm(const std::vector<int64_t>& ds) { return ds.size() == 3 && ds[0] > 0 && ds[1] == 2 && ds[2] > 0; }
std::vector<int64_t> qs_shape(const std::vector<int64_t>& ds) { return {ds[0], (ds[2] + 1) / 2, kPairBytes}; }

struct MatMulQ4_1 {
  // Constant weights (every engine's) are repacked once, here; others on every call.
  MatMulQ4_1(const OrtApi*, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo kernel_info{info};
    int qs_constant = 0, dm_constant = 0;
    const Ort::ConstValue qs = kernel_info.GetTensorConstantInput(1, &qs_constant);
    const Ort::ConstValue dm = kernel_info.GetTensorConstantInput(2, &dm_constant);
    if (!qs_constant || !dm_constant) return;
    const auto qs_info = qs.GetTensorTypeAndShapeInfo(), dm_info = dm.GetTensorTypeAndShapeInfo();
    if (qs_info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 ||
        dm_info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)
      return;  // Compute names the problem
    const std::vector<int64_t> qss = qs_info.GetShape(), ds = dm_info.GetShape();
    if (!valid_dm(ds) || qss != qs_shape(ds)) return;
    const uint8_t* nibbles = qs.GetTensorData<uint8_t>();
    const uint16_t* steps = reinterpret_cast<const uint16_t*>(dm.GetTensorData<Ort::Float16_t>());
    packed_ = pack_weights(nibbles, steps, Shape{ds[0], ds[2]});
    release_pages(nibbles, qs_info.GetElementCount());
    release_pages(steps, dm_info.GetElementCount() * sizeof(uint16_t));
  }

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
    if (!valid_dm(ds)) fail_q4("dm must be float16 [N, 2, nb] (rows d and m of each block), got " + shape_text(ds));
    const int64_t N = ds[0], nb = ds[2], K = nb * kBlock;
    if (qss != qs_shape(ds))
      fail_q4("qs must be uint8 [N, ceil(nb / 2), 32] = " + shape_text(qs_shape(ds)) + " for dm " + shape_text(ds) +
              ", got " + shape_text(qss));
    if (xs.empty() || xs.back() != K)
      fail_q4("x must be [..., K = " + std::to_string(K) + "] for dm " + shape_text(ds) + ", got " + shape_text(xs));
    if (bias != nullptr && bias->Shape() != std::vector<int64_t>{N})
      fail_q4("bias must be [N = " + std::to_string(N) + "], got " + shape_text(bias->Shape()));
    const int64_t T = x.NumberOfElement() / K;
    xs.back() = N;
    float* out = y.Allocate(xs);
    if (T == 0) return;

    PackedWeights repacked;
    const Shape shape{N, nb};
    if (packed_.empty()) repacked = pack_weights(qs.Data(), reinterpret_cast<const uint16_t*>(dm.Data()), shape);
    const uint8_t* w = packed_.empty() ? repacked.data() : packed_.data();

    // Decode-sized rows reuse a scratch of the calling thread (allocations a call measured ~4% of a decode step:
    // docs/design.md, "kiln.MatMulQ4_1"); larger batches allocate their own, so the scratch stays
    // small. `rows` is a reference: the lambdas below run on the pool's threads too.
    thread_local Int8Rows scratch;
    Int8Rows local;
    Int8Rows& rows = T <= kRowsPerItem ? scratch : local;
    rows.reset(T, K, nb);
    const float* xd = x.Data();
    auto quantize = [&](size_t t) {
      quantize_row(xd + t * K, nb, rows.q.data() + t * K, rows.step.data() + t * nb, rows.sum.data() + t * nb,
                   rows.centred_error.data() + t * nb);
    };
    if (T * K >= kParallelQuantize) parallel_for(ctx, T, quantize);
    else for (int64_t t = 0; t < T; ++t) quantize(t);

    const Problem p{w, bias ? bias->Data() : nullptr, &rows, out, N, nb, shape.group_bytes()};
    const int64_t vectors = shape.groups() * kVectorsPerGroup;
    const int64_t vectors_per_item = kGroupsPerItem * kVectorsPerGroup;
    const int64_t channel_chunks = (vectors + vectors_per_item - 1) / vectors_per_item;
    const int64_t row_chunks = (T + kRowsPerItem - 1) / kRowsPerItem;
    auto item = [&](size_t i) {
      const int64_t c = static_cast<int64_t>(i) % channel_chunks, r = static_cast<int64_t>(i) / channel_chunks;
      run_item(p, c * vectors_per_item, std::min(vectors, (c + 1) * vectors_per_item), r * kRowsPerItem,
               std::min(T, (r + 1) * kRowsPerItem));
    };
    parallel_for(ctx, static_cast<size_t>(channel_chunks * row_chunks), item);
  }

  PackedWeights packed_;  // the constant weights' records; empty: repacked per call
};

}  // namespace

void add_matmul_q4_1(Ort::CustomOpDomain& domain) {
  domain.Add(Ort::Custom::CreateLiteCustomOp<MatMulQ4_1>("MatMulQ4_1", "CPUExecutionProvider"));
}

}  // namespace kiln
