// kiln.MatMulGGUF's Q8_0 weights as records (layout "records"; the layout and its spec: kiln/gguf_records.py): a
// GGUF Q8_0 block is 32 int8 codes with w = d q. The records put 16 channels in the lanes as kiln.MatMulQ4_1's do,
// 8 blocks (a superblock of 256 inputs) a record, so the tile is q4_1::tile with this block.
//
// A record [4352 bytes, 68 cache lines] holds 8 blocks of a group of 16 channels: per block s, 8 chunks of 64 bytes
// (lane l's 4 bytes of chunk j: channel l's codes for inputs 32s + 4j + i, plus 128), then d[s][lane] (float16).
//
// Per block and row the dot of the codes with the int8 row is exact in int32, then acc += d (xs isum). With
// vpdpbusd the codes plus 128 are its unsigned operand and 128 times the row's int sum over the block (its two sums
// of 16) comes off the dot; AVX2's maddubs would saturate on such bytes, so there the signed codes' magnitudes meet
// the row's int8 with the codes' signs (pairs at most 2 x 128 x 127, within int16) and each chunk's pairs are summed
// into int32 at once.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "q4_1_records.h"

namespace kiln {
namespace q8_0 {

using q4_1::kGroup;
using q4_1::VF;
using q4_1::VI;

constexpr int64_t kBlocks = q4_1::kSuperblockBlocks;              // blocks of 32 a record
constexpr int64_t kChunks = 8;                                     // a block's chunks: 4 inputs x 16 lanes each
constexpr int64_t kBlockBytes = kChunks * q4_1::kChunkBytes;      // 512
constexpr int64_t kDOffset = kBlocks * kBlockBytes;               // 4096: d[8][16], float16
constexpr int64_t kRecordBytes = kDOffset + kBlocks * kGroup * 2;  // 4352

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
constexpr int32_t kDotOffset = 128;  // what each code carries into the dots: its 128
struct Chunk {
  VI biased;
};
inline Chunk load(const uint8_t* p) { return {q4_1::load_chunk(p)}; }
inline VI dot4(VI acc, const Chunk& c, const int8_t* x) { return q4_1::dot4(acc, c.biased, x); }
#else
constexpr int32_t kDotOffset = 0;
struct Chunk {
  VI code, magnitude;
};
inline Chunk load(const uint8_t* p) {
  const VI code = _mm256_xor_si256(q4_1::load_chunk(p), _mm256_set1_epi8(static_cast<char>(0x80)));
  return {code, _mm256_abs_epi8(code)};
}
inline VI dot4(VI acc, const Chunk& c, const int8_t* x) {
  int32_t x4;
  std::memcpy(&x4, x, 4);
  const VI pairs = _mm256_maddubs_epi16(c.magnitude, _mm256_sign_epi8(_mm256_set1_epi32(x4), c.code));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif

// Decode's prefetch (16 blocks ahead, as the k-quants') covers a block's 544 bytes and keeps them in the caches:
// measured on the Llama-3.2-1B shape's Q8_0 steps (Zen 4), a non-temporal prefetch was 1.04-1.08x the step and
// Q4_1's 320 bytes a block 1.08x (Q4_K's records are the other way round: non-temporal 0.93x).
struct Format : q4_1::SuperblockRecord<kRecordBytes> {
  static constexpr const char* kName = "Q8_0";  // in messages
  static constexpr int kPassRows = q4_1::kPassRows;  // its blocks' steps are one float16 load each
  static constexpr int64_t kPrefetchBytes = kRecordBytes / kBlocks;  // 9 lines from any start
  static constexpr bool kNonTemporalOnce = false;
  static constexpr bool kSums16 = kDotOffset != 0;
  struct RecordSteps {};
  static RecordSteps record_steps(const uint8_t*, int64_t) { return {}; }
  template <int NT>
  static void block(const uint8_t* record, int64_t s, const RecordSteps&, int64_t lane_bytes,
                    const q4_1::Int8Rows& x, const int8_t* const* xq, int64_t t0, int64_t b, VF* acc) {
    using namespace q4_1;  // NOLINT: the vector primitives
    const uint8_t* codes = record + s * kBlockBytes + lane_bytes * 4;
    const VF d = load_f16(record + kDOffset + s * kGroup * 2 + lane_bytes * 2);
    VI dots[NT];
    for (int r = 0; r < NT; ++r) dots[r] = zero_i();
    if constexpr (NT == 1) {  // decode: four independent chains, not one of 8 dependent dots (1.04x the step)
      const int8_t* x = xq[0] + b * kBlock;
      VI part[4] = {zero_i(), zero_i(), zero_i(), zero_i()};
#pragma GCC unroll 8
      for (int64_t j = 0; j < kChunks; ++j)
        part[j % 4] = q8_0::dot4(part[j % 4], q8_0::load(codes + j * kChunkBytes), x + 4 * j);
      dots[0] = add_i(add_i(part[0], part[1]), add_i(part[2], part[3]));  // integers: the same sum in any order
    } else {
#pragma GCC unroll 8
      for (int64_t j = 0; j < kChunks; ++j) {
        const Chunk chunk = q8_0::load(codes + j * kChunkBytes);
#pragma GCC unroll 16
        for (int r = 0; r < NT; ++r) dots[r] = q8_0::dot4(dots[r], chunk, xq[r] + b * kBlock + 4 * j);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < NT; ++r) {
      const int64_t t = t0 + r;
      VI isum = dots[r];
      if constexpr (kDotOffset != 0) {
        const int32_t* sums = x.sums16.data() + t * (x.K / 16) + 2 * b;
        isum = sub_i(isum, kDotOffset * (sums[0] + sums[1]));
      }
      acc[r] = fmadd(d, mul(to_float(isum), broadcast(&x.step[t * x.nb + b])), acc[r]);
    }
  }
};

}  // namespace q8_0
}  // namespace kiln
