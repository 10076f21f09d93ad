// kiln.MatMulGGUF's Q5_K weights as records (layout "records"; the layout and its spec: kiln/gguf_records.py): a
// GGUF Q5_K superblock is Q4_K's with a fifth bit on each code (q 0..31), w = (d sc_j) q - (dmin m_j). Its records
// are Q4_K's (q4_k_records.h) with a 64-byte chunk of fifth bits a block after the nibbles, and the tile is
// q4_1::tile with this block.
//
// A record [2880 bytes, 45 cache lines] holds one superblock of a group of 16 channels: the 8 blocks' nibbles (256
// bytes each, as Q4_1's record), the 8 blocks' fifth bits (64 bytes each: lane l's byte i holds, at bit 2j, the fifth
// bit of the input in chunk j's low nibble and at bit 2j + 1 that of its high nibble), then sc[8][16], m[8][16]
// (bytes), the 16 d and the 16 dmin (float16).
//
// Per block and row: each chunk's low and high codes (nibble | fifth bit at bit 4) dotted with the int8 row into
// int32 (AVX2's maddubs pairs reach 2 x 31 x 127, so a chunk's two are folded into int32 at once), then Q4_1's
// epilogue with the 5-bit codes' mean, 15.5, in place of 7.5.
#pragma once

#include <cstdint>

#include "q4_1_records.h"

namespace kiln {
namespace q5_k {

using q4_1::kChunkBytes;
using q4_1::kChunks;
using q4_1::kGroup;
using q4_1::VF;
using q4_1::VI;

constexpr int64_t kBlocks = q4_1::kSuperblockBlocks;             // blocks of 32 a superblock
constexpr int64_t kBlockBytes = kChunks * kChunkBytes;          // 256: a block's nibbles
constexpr int64_t kHighOffset = kBlocks * kBlockBytes;          // 2048: the fifth bits, a chunk a block
constexpr int64_t kScalesOffset = kHighOffset + kBlocks * kChunkBytes;  // 2560: sc[8][16]
constexpr int64_t kMinsOffset = kScalesOffset + kBlocks * kGroup;       // m[8][16]
constexpr int64_t kDOffset = kMinsOffset + kBlocks * kGroup;            // d[16], float16
constexpr int64_t kDminOffset = kDOffset + kGroup * 2;                  // dmin[16], float16
constexpr int64_t kRecordBytes = kDminOffset + kGroup * 2;              // 2880
constexpr float kCentreRatio = 15.5f / q4_1::kCentre;  // Int8Rows holds 7.5 E; 5-bit codes are centred at 15.5

struct Format : q4_1::SuperblockRecord<kRecordBytes> {
  static constexpr bool kSums16 = false;
  struct RecordSteps {
    VF d, dmin;
  };
  static RecordSteps record_steps(const uint8_t* record, int64_t lane_bytes) {
    return {q4_1::load_f16(record + kDOffset + lane_bytes * 2), q4_1::load_f16(record + kDminOffset + lane_bytes * 2)};
  }
  template <int NT>
  static void block(const uint8_t* record, int64_t s, const RecordSteps& steps, int64_t lane_bytes,
                    const q4_1::Int8Rows& x, const int8_t* const* xq, int64_t t0, int64_t b, VF* acc) {
    using namespace q4_1;  // NOLINT: the vector primitives
    const VF d = mul(steps.d, load_u8(record + kScalesOffset + s * kGroup + lane_bytes));
    const VF m = negate(mul(steps.dmin, load_u8(record + kMinsOffset + s * kGroup + lane_bytes)));
    const uint8_t* nibbles = record + s * kBlockBytes + lane_bytes * 4;
    const VI high = load_chunk(record + kHighOffset + s * kChunkBytes + lane_bytes * 4);
    VI dots[NT];
    for (int r = 0; r < NT; ++r) dots[r] = zero_i();
#pragma GCC unroll 4
    for (int64_t j = 0; j < kChunks; ++j) {
      const VI raw = load_chunk(nibbles + j * kChunkBytes);
      const VI lo = or_i(low_nibbles(raw), fifth_bits(high, 4 - 2 * static_cast<int>(j)));
      const VI hi = or_i(high_nibbles(raw), fifth_bits(high, 3 - 2 * static_cast<int>(j)));
#pragma GCC unroll 16
      for (int r = 0; r < NT; ++r) dots[r] = dot8_32(dots[r], lo, hi, xq[r] + b * kBlock + 8 * j);
    }
    const VF ratio = broadcast(&kCentreRatio);
#pragma GCC unroll 16
    for (int r = 0; r < NT; ++r) {
      const int64_t i = (t0 + r) * x.nb + b;
      const VF scaled = fmadd(to_float(dots[r]), broadcast(&x.step[i]), mul(broadcast(&x.centred_error[i]), ratio));
      acc[r] = fmadd(m, broadcast(&x.sum[i]), fmadd(d, scaled, acc[r]));
    }
  }
};

}  // namespace q5_k
}  // namespace kiln
