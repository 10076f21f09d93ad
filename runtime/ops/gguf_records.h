// kiln.MatMulGGUF's records (kiln/gguf_records.py) by ggml type: what kiln.MatMulGGUF and kiln.MoE's GGUF experts
// (layout "records") run on them, kiln.MatMulQ4_1's tile with the type's record format.
#pragma once

#include <cstdint>

#include "q4_1_records.h"
#include "q4_k_records.h"
#include "q5_k_records.h"
#include "q6_k_records.h"
#include "q8_0_records.h"

namespace kiln {
namespace gguf_records {

constexpr int64_t kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;  // the ggml type ids with records
constexpr int64_t kSuperBlock = 256;

// fn(Format{}) with the type's record format; false for a type without records.
template <class Fn>
inline bool with_format(int64_t type, Fn&& fn) {
  switch (type) {
    case kQ4_K: fn(q4_k::Format{}); return true;
    case kQ5_K: fn(q5_k::Format{}); return true;
    case kQ6_K: fn(q6_k::Format{}); return true;
    case kQ8_0: fn(q8_0::Format{}); return true;
    default: return false;
  }
}

// A record's bytes for the type (a superblock of 256 inputs x 16 channels), 0 for a type without records.
inline int64_t record_bytes(int64_t type) {
  int64_t bytes = 0;
  with_format(type, [&](auto format) { bytes = decltype(format)::kRecordBytes; });
  return bytes;
}
// The type's name in messages ("" for a type without records).
inline const char* type_name(int64_t type) {
  const char* name = "";
  with_format(type, [&](auto format) { name = decltype(format)::kName; });
  return name;
}

// out = rows row(0) .. row(T - 1) quantized as the type's tile reads them: with the rows' int sums of 16 where the
// format asks for them (Q6_K's and Q8_0's offsets) and E times its codes' mean (Q5_K: 15.5; the nibbles: 7.5).
template <class RowFn>
inline void quantize_rows(OrtKernelContext* ctx, int64_t type, int64_t T, int64_t K, RowFn&& row,
                          q4_1::Int8Rows& out) {
  with_format(type, [&](auto format) {
    using Format = decltype(format);
    q4_1::quantize_rows(ctx, T, K, Format::kSums16, Format::kCentre, row, out);
  });
}

// y [T, N] = x [T, K] times records of `type` (each group of 16 channels K / 256 records), on the session's threads.
inline void multiply(OrtKernelContext* ctx, int64_t type, const uint8_t* w, const float* x, const float* bias,
                     float* y, int64_t T, int64_t N, int64_t K) {
  const int64_t group_bytes = K / kSuperBlock * record_bytes(type);
  with_format(type, [&](auto format) {
    q4_1::multiply<decltype(format)>(ctx, w, group_bytes, x, bias, y, T, N, K);
  });
}

// One work item of records of `type`: channel vectors [v0, v1) x rows [t0, t1) of p (q4_1::run_item).
inline void run_item(int64_t type, const q4_1::Problem& p, int64_t v0, int64_t v1, int64_t t0, int64_t t1) {
  with_format(type, [&](auto format) { q4_1::run_item<decltype(format)>(p, v0, v1, t0, t1); });
}

}  // namespace gguf_records
}  // namespace kiln
