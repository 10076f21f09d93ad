// kiln.MatMulQ4_1's calls of many rows on AMX (Intel Sapphire Rapids and later): the same int32 block dots as the
// vpdpbusd tile, computed by the tile unit, then the same float epilogue in the same order, so a row's outputs are
// bitwise the VNNI tile's (and the AVX2 library's) for every T.
//
// A work item is up to 4 channel groups x up to 64 rows. A group's blocks are first unpacked into the tile unit's
// B layout (8 rows of 64 bytes: row k holds the 16 channels' inputs 4k..4k+3, a byte each; nibbles 0..15 are valid
// int8). A record's chunk j holds, per channel, inputs 8j..8j+3 in its low nibbles and 8j+4..8j+7 in its high
// ones, so rows 2j and 2j + 1 are the chunk's two nibble halves. Then, 16 rows at a time, block by block:
//   A: the 16 rows' 32 int8 activations of the block, read in place (the rows padded to a multiple of 16);
//   C = A x B (tdpbssd into a zeroed int32 tile), stored to L1 two blocks later and scaled one block after that:
//      four C tiles in rotation, so the tile unit works ahead of the stores and the vector epilogue;
//   per row, acc += d (xs dot + c E) + m S, the 16 rows' accumulators in registers.
// A block's dots must be scaled before the next block's are added (d and xs change every 32 inputs), so each
// 16x16x32 product is stored and converted: that bounds the gain (docs/design.md, "kiln.MatMulQ4_1").
//
// The tile unit is used only where the CPU has AMX-INT8, Linux grants this process the tile data state
// (arch_prctl ARCH_REQ_XCOMP_PERM), and KILN_OPS_ISA does not name another path; otherwise kiln.MatMulQ4_1 keeps
// the vpdpbusd tile. The AVX2 library has no AMX path (try_multiply declines).
#pragma once

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "q4_1_records.h"

namespace kiln {
namespace amx {

constexpr int64_t kMinRows = 32;  // from this many rows a call takes the tile unit (benchmarks/bench_matmul_q4_1.py)
constexpr int64_t kTileRows = 16;

// Whether this process may use AMX-INT8: the CPU says so (CPUID.7.0:EDX bits 24, 25), Linux grants the tile data
// state (XFEATURE 18), and $KILN_OPS_ISA is unset, "auto" or "amx". Asked once per process.
inline bool detect() {
  const char* isa = std::getenv("KILN_OPS_ISA");
  if (isa != nullptr && *isa != '\0' && std::strcmp(isa, "auto") != 0 && std::strcmp(isa, "amx") != 0) return false;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!(edx & (1u << 24)) || !(edx & (1u << 25))) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) == 0;
}

inline bool available() {
  static const bool ok = detect();
  return ok;
}

// How many calls took the tile unit in this process (tests and benchmarks read it: kiln_amx_multiplies()).
inline std::atomic<int64_t>& multiplies() {
  static std::atomic<int64_t> count{0};
  return count;
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
using q4_1::Int8Rows;
using q4_1::kBlock;
using q4_1::kChunkBytes;
using q4_1::kChunks;
using q4_1::kGroup;
using q4_1::kRecordBytes;
using q4_1::kStepsOffset;

// ldtilecfg's 64-byte operand, palette 1: tiles 0-3 C (16 rows x 16 int32), 4-5 A (16 rows x 32 int8), 6-7 B
// (8 rows x 64 bytes); block b takes C b % 4 and A, B b % 2.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 4; ++t) colsb[t] = 64, rows[t] = kTileRows;
    for (int t = 4; t < 6; ++t) colsb[t] = kBlock, rows[t] = kTileRows;
    for (int t = 6; t < 8; ++t) colsb[t] = 64, rows[t] = kBlock / 4;
  }
};

// A group's block as tile B's 8 rows of 64 bytes (see the file's comment).
__attribute__((always_inline)) inline void unpack_block(const uint8_t* record, uint8_t* out) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t j = 0; j < kChunks; ++j) {
    const __m512i raw = _mm512_loadu_si512(record + j * kChunkBytes);
    _mm512_store_si512(out + 2 * j * 64, _mm512_and_si512(raw, mask));
    _mm512_store_si512(out + (2 * j + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask));
  }
}

constexpr int64_t kUnpackedBlockBytes = kChunks * 2 * 64;

// The rows' per-block terms (Int8Rows' step, centred_error, sum) block-major, [nb][padded rows] each: a tile's 16
// rows read theirs at fixed offsets from one pointer (row-major, the index arithmetic measured 1.2x the epilogue).
struct BlockTerms {
  q4_1::AlignedVector<float> step, centred_error, sum;
  int64_t rows = 0;
  void fill(const Int8Rows& x, int64_t T, int64_t padded) {
    rows = padded;
    for (auto* v : {&step, &centred_error, &sum}) v->assign(x.nb * padded, 0.f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t b = 0; b < x.nb; ++b) {
        step[b * padded + t] = x.step[t * x.nb + b];
        centred_error[b * padded + t] = x.centred_error[t * x.nb + b];
        sum[b * padded + t] = x.sum[t * x.nb + b];
      }
  }
};

// The 16 rows' dots of block b (a C tile stored to L1) scaled into their accumulators: the vpdpbusd tile's epilogue
// (q4_1_block), term for term.
__attribute__((always_inline)) inline void scale_block(const int32_t* dots, const uint8_t* record,
                                                       const BlockTerms& bt, int64_t t0, int64_t b, q4_1::VF* acc) {
  const q4_1::VF d = q4_1::load_f16(record + kStepsOffset), m = q4_1::load_f16(record + kStepsOffset + kGroup * 2);
  const float* xs = bt.step.data() + b * bt.rows + t0;
  const float* ce = bt.centred_error.data() + b * bt.rows + t0;
  const float* S = bt.sum.data() + b * bt.rows + t0;
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) {
    const __m512i dot = _mm512_load_si512(dots + r * kGroup);
    const q4_1::VF scaled = q4_1::fmadd(q4_1::to_float(dot), q4_1::broadcast(xs + r), q4_1::broadcast(ce + r));
    acc[r] = q4_1::fmadd(m, q4_1::broadcast(S + r), q4_1::fmadd(d, scaled, acc[r]));
  }
}

// Block products into C tile C from A tile A (16 rows at xb) and B tile B (the unpacked block). A macro: GCC's tile
// intrinsics paste their tile numbers into the instruction's text, so they must be literals.
#define KILN_AMX_ISSUE(C, A, B, xb, stride, unpacked) \
  _tile_loadd(A, xb, stride);                          \
  _tile_loadd(B, unpacked, 64);                        \
  _tile_zero(C);                                       \
  _tile_dpbssd(C, A, B)

// Group g (its blocks unpacked) x the 16 rows from t0, of which the first `rows` are the call's (the others are
// padding: computed, not stored). `next`, when given, is the item's next group, whose records are prefetched a
// block at a time meanwhile (unpacked only after this group's rows, they would otherwise stream in unhidden: a
// 32-row decode step of the 1B shape measured 1.04x the vpdpbusd tile's without it, 0.96x with it).
__attribute__((target("amx-tile,amx-int8"), noinline)) inline void group_rows(const q4_1::Problem& p,
                                                                               const BlockTerms& terms, int64_t g,
                                                                               const uint8_t* unpacked, int64_t t0,
                                                                               int64_t rows, const uint8_t* next) {
  const Int8Rows& x = *p.x;
  const uint8_t* records = p.w + g * p.group_bytes;
  const int8_t* xq = x.q.data() + t0 * x.K;
  const int64_t stride = x.K;
  q4_1::VF acc[kTileRows];
  for (int r = 0; r < kTileRows; ++r) acc[r] = q4_1::zero_f();
  alignas(64) int32_t ring[4][kTileRows * kGroup];
  constexpr int64_t kLag = 1;  // blocks between a block's store and its scaling (0 and 2 measured slower)
  for (int64_t b = 0; b < p.nb + 2 + kLag; ++b) {
    if (b < p.nb) {
      if (next) q4_1::prefetch_record(next + b * kRecordBytes, false);
      const int8_t* xb = xq + b * kBlock;
      const uint8_t* ub = unpacked + b * kUnpackedBlockBytes;
      switch (b & 3) {
        case 0: KILN_AMX_ISSUE(0, 4, 6, xb, stride, ub); break;
        case 1: KILN_AMX_ISSUE(1, 5, 7, xb, stride, ub); break;
        case 2: KILN_AMX_ISSUE(2, 4, 6, xb, stride, ub); break;
        default: KILN_AMX_ISSUE(3, 5, 7, xb, stride, ub); break;
      }
    }
    const int64_t c = b - 2;
    if (c >= 0 && c < p.nb) switch (c & 3) {
      case 0: _tile_stored(0, ring[0], 64); break;
      case 1: _tile_stored(1, ring[1], 64); break;
      case 2: _tile_stored(2, ring[2], 64); break;
      default: _tile_stored(3, ring[3], 64); break;
    }
    const int64_t e = c - kLag;
    if (e < 0) continue;
    scale_block(ring[e & 3], records + e * kRecordBytes, terms, t0, e, acc);
  }
  const int64_t n = g * kGroup, count = std::min<int64_t>(kGroup, p.N - n);
  const q4_1::VF bias = p.bias ? q4_1::load_lanes(p.bias + n, count) : q4_1::zero_f();
  for (int64_t r = 0; r < rows; ++r)
    q4_1::store_lanes(p.y + (t0 + r) * p.N + n, p.bias ? acc[r] + bias : acc[r], count);
}

constexpr int64_t kGroupsPerItem = 4;  // 2 measured 1.04x a 32-row step of the 1B shape: less of it prefetched
constexpr int64_t kRowsPerItem = 64;

// Channel groups [g_begin, g_end) x rows [t0, t0 + rows) of p, whose activation rows are padded to a multiple of 16.
__attribute__((target("amx-tile,amx-int8"), noinline)) inline void item(const q4_1::Problem& p,
                                                                         const BlockTerms& terms, int64_t g_begin,
                                                                         int64_t g_end, int64_t t0, int64_t rows) {
  static const TileConfig config;
  thread_local q4_1::AlignedVector<uint8_t> unpacked;
  unpacked.resize(p.nb * kUnpackedBlockBytes);
  _tile_loadconfig(&config);
  for (int64_t g = g_begin; g < g_end; ++g) {
    for (int64_t b = 0; b < p.nb; ++b)
      unpack_block(p.w + g * p.group_bytes + b * kRecordBytes, unpacked.data() + b * kUnpackedBlockBytes);
    const uint8_t* next = g + 1 < g_end ? p.w + (g + 1) * p.group_bytes : nullptr;
    for (int64_t t = t0; t < t0 + rows; t += kTileRows)
      group_rows(p, terms, g, unpacked.data(), t, std::min<int64_t>(kTileRows, t0 + rows - t),
                 t == t0 ? next : nullptr);
  }
  _tile_release();
}

// y [T, N] = x [T, K] times Q4_1 records w on the tile unit, when it is there and T has kMinRows or more; returns
// whether it ran (q4_1::multiply's contract and work items, its outputs bit for bit).
inline bool try_multiply(OrtKernelContext* ctx, const uint8_t* w, int64_t group_bytes, const float* x,
                         const float* bias, float* y, int64_t T, int64_t N, int64_t K, float centre) {
  if (T < kMinRows || !available()) return false;
  // The call's own rows and terms, as q4_1::multiply's beyond decode-sized calls: a thread_local scratch would keep
  // the largest prefill's buffers for the process's life.
  Int8Rows rows;
  q4_1::quantize_rows(ctx, T, K, false, centre, [&](size_t t) { return x + t * K; }, rows);
  const int64_t padded = (T + kTileRows - 1) / kTileRows * kTileRows;  // whole tiles of rows, the padding zeros
  rows.q.resize(padded * K, 0);
  BlockTerms terms;
  terms.fill(rows, T, padded);
  const q4_1::Problem p{w, bias, &rows, y, N, K / kBlock, group_bytes};
  const int64_t groups = (N + kGroup - 1) / kGroup;
  const int64_t channel_chunks = (groups + kGroupsPerItem - 1) / kGroupsPerItem;
  const int64_t row_chunks = (T + kRowsPerItem - 1) / kRowsPerItem;
  auto work = [&](size_t i) {
    const int64_t c = static_cast<int64_t>(i) % channel_chunks, r = static_cast<int64_t>(i) / channel_chunks;
    item(p, terms, kGroupsPerItem * c, std::min(groups, kGroupsPerItem * (c + 1)), kRowsPerItem * r,
         std::min(kRowsPerItem, T - kRowsPerItem * r));
  };
  parallel_for(ctx, static_cast<size_t>(channel_chunks * row_chunks), work);
  multiplies().fetch_add(1, std::memory_order_relaxed);
  return true;
}
#else
inline bool try_multiply(OrtKernelContext*, const uint8_t*, int64_t, const float*, const float*, float*, int64_t,
                         int64_t, int64_t, float) {
  return false;
}
#endif

}  // namespace amx
}  // namespace kiln
