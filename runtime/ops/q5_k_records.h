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
// epilogue with the 5-bit codes' mean, 15.5, in place of 7.5 (the rows are quantized with 15.5 E: kCentre).
#pragma once

#include <cstdint>

#include "q4_1_records.h"
#include "q4_k_records.h"

namespace kiln {
namespace q5_k {

constexpr int64_t kHighOffset = q4_k::kScalesOffset;  // 2048: the fifth bits after Q4_K's nibbles, a chunk a block
using Tail = q4_k::AffineTail<kHighOffset + q4_k::kBlocks * q4_1::kChunkBytes>;  // from 2560
constexpr int64_t kRecordBytes = Tail::kEnd;  // 2880

struct Format : q4_1::SuperblockRecord<kRecordBytes>, Tail {
  static constexpr const char* kName = "Q5_K";  // in messages
  static constexpr bool kSums16 = false;
  static constexpr float kCentre = 15.5f;  // the 5-bit codes' mean
  template <int NT>
  static void block(const uint8_t* record, int64_t s, const RecordSteps& steps, int64_t lane_bytes,
                    const q4_1::Int8Rows& x, const int8_t* const* xq, int64_t t0, int64_t b, q4_1::VF* acc) {
    using namespace q4_1;  // NOLINT: the vector primitives
    VF d, m;
    block_steps(record, s, steps, lane_bytes, d, m);
    const uint8_t* nibbles = record + s * q4_k::kBlockBytes + lane_bytes * 4;
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
#pragma GCC unroll 16
    for (int r = 0; r < NT; ++r) {
      const int64_t i = (t0 + r) * x.nb + b;
      const VF scaled = fmadd(to_float(dots[r]), broadcast(&x.step[i]), broadcast(&x.centred_error[i]));
      acc[r] = fmadd(m, broadcast(&x.sum[i]), fmadd(d, scaled, acc[r]));
    }
  }
};

}  // namespace q5_k
}  // namespace kiln
