// kiln.MatMulGGUF's Q4_K weights as records (layout "records"; the layout and its spec: kiln/gguf_records.py):
// a GGUF Q4_K superblock of 256 inputs is 8 blocks of 32 with w = (d sc_j) q - (dmin m_j), i.e. 8 Q4_1 blocks
// whose step and minimum are the float32 products of the superblock's float16 d, dmin and the 6-bit sc_j, m_j. So
// the records are Q4_1's records 8 blocks at a time, with the scales left as the file's integers, and the tile,
// the activations' quantization and the arithmetic are kiln.MatMulQ4_1's (q4_1_records.h).
//
// A record [2368 bytes, 37 cache lines] holds one superblock of a group of 16 channels: blocks s = 0..7 of 256
// bytes each (Q4_1's 4 chunks of 64: lane l's 4 bytes of chunk j hold channel l's inputs 32s + 8j + i, low nibble,
// and 32s + 8j + 4 + i, high), then sc[s][lane] and m[s][lane] (bytes), then the 16 d and the 16 dmin (float16).
#pragma once

#include <cstdint>

#include "q4_1_records.h"

namespace kiln {
namespace q4_k {

using q4_1::kChunkBytes;
using q4_1::kChunks;
using q4_1::kGroup;
using q4_1::VF;
using q4_1::load_u8;
using q4_1::mul;
using q4_1::negate;

constexpr int64_t kBlocks = q4_1::kSuperblockBlocks;             // blocks of 32 a superblock
constexpr int64_t kBlockBytes = kChunks * kChunkBytes;          // 256: a block's nibbles
constexpr int64_t kScalesOffset = kBlocks * kBlockBytes;        // sc[8][16]

// What Q4_K's and Q5_K's records (q5_k_records.h) end with, from byte Offset: sc[8][16] and m[8][16] (bytes), the
// 16 d and the 16 dmin (float16); and q4_1::tile's view of it, block s's step d sc_s and minimum -(dmin m_s), the
// spec's float32 products (the negation is exact, so m S + ... is the spec's ... - (dmin m_s) S).
template <int64_t Offset>
struct AffineTail {
  static constexpr int64_t kScales = Offset, kMins = kScales + kBlocks * kGroup, kD = kMins + kBlocks * kGroup;
  static constexpr int64_t kDmin = kD + kGroup * 2, kEnd = kDmin + kGroup * 2;
  struct RecordSteps {
    VF d, dmin;
  };
  static RecordSteps record_steps(const uint8_t* record, int64_t lane_bytes) {
    return {q4_1::load_f16(record + kD + lane_bytes * 2), q4_1::load_f16(record + kDmin + lane_bytes * 2)};
  }
  static void block_steps(const uint8_t* record, int64_t s, const RecordSteps& steps, int64_t lane_bytes, VF& d,
                          VF& m) {
    d = mul(steps.d, load_u8(record + kScales + s * kGroup + lane_bytes));
    m = negate(mul(steps.dmin, load_u8(record + kMins + s * kGroup + lane_bytes)));
  }
};

using Tail = AffineTail<kScalesOffset>;
constexpr int64_t kRecordBytes = Tail::kEnd;  // 2368

struct Format : q4_1::SuperblockRecord<kRecordBytes>, Tail {
  static constexpr const char* kName = "Q4_K";  // in messages
  static constexpr bool kSums16 = false;
  template <int NT>
  static void block(const uint8_t* record, int64_t s, const RecordSteps& steps, int64_t lane_bytes,
                    const q4_1::Int8Rows& x, const int8_t* const* xq, int64_t t0, int64_t b, VF* acc) {
    VF d, m;
    block_steps(record, s, steps, lane_bytes, d, m);
    q4_1::q4_1_block<NT>(record + s * kBlockBytes, d, m, x, xq, t0, b, lane_bytes, acc);
  }
};

}  // namespace q4_k
}  // namespace kiln
