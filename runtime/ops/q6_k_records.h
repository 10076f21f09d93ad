// kiln.MatMulGGUF's Q6_K weights as records (layout "records"; the layout and its spec: kiln/gguf_records.py): a
// GGUF Q6_K superblock of 256 inputs is 16 groups of 16 with w = (d sc_g) (q - 32), q a 6-bit code and sc_g an int8
// scale. The records put 16 channels in the lanes as kiln.MatMulQ4_1's do: a block of 32 inputs is Q4_1's 4 chunks
// of low nibbles plus 2 chunks of the codes' high 2 bits, and the tile is q4_1::tile with this block.
//
// A record [3392 bytes, 53 cache lines] holds one superblock of a group of 16 channels: the 8 blocks' nibbles
// (256 bytes each, as Q4_1's record), then the 8 blocks' high bits (128 bytes each: in high chunk h, lane l's byte
// i holds bits 4-5 of inputs 16h + i, 16h + 4 + i, 16h + 8 + i and 16h + 12 + i of the block, two bits each, low to
// high), then sc[16][lane] (int8), d[lane] (float16) and 32 bytes of zeros.
//
// Per block and row, each group of 16 is one exact int32 dot of the codes with the int8 row minus 32 times the
// row's int sum of those 16 (the offset, exact), then acc += (d sc_g) (xs isum_g): the activations' step xs is the
// block of 32's, as for Q4_1.
#pragma once

#include <cstdint>

#include "q4_1_records.h"

namespace kiln {
namespace q6_k {

using q4_1::kChunkBytes;
using q4_1::kChunks;
using q4_1::kGroup;
using q4_1::VF;
using q4_1::VI;

constexpr int64_t kBlocks = q4_1::kSuperblockBlocks;             // blocks of 32 a superblock
constexpr int64_t kBlockBytes = kChunks * kChunkBytes;            // 256: a block's low nibbles
constexpr int64_t kHighBytes = 2 * kChunkBytes;                   // 128: a block's high bits
constexpr int64_t kHighOffset = kBlocks * kBlockBytes;            // 2048
constexpr int64_t kScalesOffset = kHighOffset + kBlocks * kHighBytes;  // 3072: sc[16][16]
constexpr int64_t kDOffset = kScalesOffset + 2 * kBlocks * kGroup;     // 3328: d[16], float16
constexpr int64_t kRecordBytes = kDOffset + kGroup * 2 + 32;           // 3392, with 32 bytes of padding

struct Format : q4_1::SuperblockRecord<kRecordBytes> {
  static constexpr const char* kName = "Q6_K";  // in messages
  static constexpr bool kSums16 = true;
  struct RecordSteps {
    VF d;
  };
  static RecordSteps record_steps(const uint8_t* record, int64_t lane_bytes) {
    return {q4_1::load_f16(record + kDOffset + lane_bytes * 2)};
  }
  template <int NT>
  static void block(const uint8_t* record, int64_t s, const RecordSteps& steps, int64_t lane_bytes,
                    const q4_1::Int8Rows& x, const int8_t* const* xq, int64_t t0, int64_t b, VF* acc) {
    using namespace q4_1;  // NOLINT: the vector primitives
    const uint8_t* nibbles = record + s * kBlockBytes;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // group 2s + h: chunks 2h and 2h + 1
      const VI high = load_chunk(record + kHighOffset + s * kHighBytes + h * kChunkBytes + lane_bytes * 4);
      const VF scale = mul(steps.d, load_i8(record + kScalesOffset + (2 * s + h) * kGroup + lane_bytes));
      VI dots[NT];
      for (int r = 0; r < NT; ++r) dots[r] = zero_i();
#pragma GCC unroll 2
      for (int c = 0; c < 2; ++c) {
        const VI raw = load_chunk(nibbles + (2 * h + c) * kChunkBytes + lane_bytes * 4);
        // bits 4c..4c+1 of the high byte go with the low nibbles, 4c+2..4c+3 with the high ones
        const VI lo = or_i(low_nibbles(raw), high_bits(high, 4 - 4 * c));
        const VI hi = or_i(high_nibbles(raw), high_bits(high, 2 - 4 * c));
#pragma GCC unroll 16
        for (int r = 0; r < NT; ++r) dots[r] = dot8_32(dots[r], lo, hi, xq[r] + b * kBlock + 16 * h + 8 * c);
      }
#pragma GCC unroll 16
      for (int r = 0; r < NT; ++r) {
        const int64_t t = t0 + r;
        const VI isum = sub_i(dots[r], 32 * x.sums16[t * (x.K / 16) + 2 * b + h]);
        acc[r] = fmadd(scale, mul(to_float(isum), broadcast(&x.step[t * x.nb + b])), acc[r]);
      }
    }
  }
};

}  // namespace q6_k
}  // namespace kiln
