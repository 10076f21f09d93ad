// kiln.MatMulGGUF's records (kiln/gguf_records.py) by ggml type: what kiln.MatMulGGUF and kiln.MoE's GGUF experts
// (layout "records") run on them, kiln.MatMulQ4_1's tile with the type's record format.
#pragma once

#include <cstdint>

#include "q4_1_records.h"
#include "q4_k_records.h"
#include "q6_k_records.h"
#include "q8_0_records.h"

namespace kiln {
namespace gguf_records {

constexpr int64_t kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;  // the ggml type ids with records

// A record's bytes for the type (a superblock of 256 inputs x 16 channels), 0 for a type without records.
inline int64_t record_bytes(int64_t type) {
  return type == kQ4_K ? q4_k::kRecordBytes : type == kQ6_K ? q6_k::kRecordBytes
                                          : type == kQ8_0 ? q8_0::kRecordBytes : 0;
}
// The type's name in messages.
inline const char* type_name(int64_t type) { return type == kQ4_K ? "Q4_K" : type == kQ6_K ? "Q6_K" : "Q8_0"; }
constexpr int64_t kSuperBlock = 256;

// Whether the type's tile reads the rows' int sums of 16 (q4_1::Int8Rows::sums16).
inline bool needs_sums16(int64_t type) {
  return type == kQ4_K ? q4_k::Format::kSums16 : type == kQ6_K ? q6_k::Format::kSums16 : q8_0::Format::kSums16;
}

// y [T, N] = x [T, K] times records of `type` (each group of 16 channels K / 256 records), on the session's threads.
inline void multiply(OrtKernelContext* ctx, int64_t type, const uint8_t* w, const float* x, const float* bias,
                     float* y, int64_t T, int64_t N, int64_t K) {
  const int64_t group_bytes = K / kSuperBlock * record_bytes(type);
  if (type == kQ4_K) q4_1::multiply<q4_k::Format>(ctx, w, group_bytes, x, bias, y, T, N, K);
  else if (type == kQ6_K) q4_1::multiply<q6_k::Format>(ctx, w, group_bytes, x, bias, y, T, N, K);
  else q4_1::multiply<q8_0::Format>(ctx, w, group_bytes, x, bias, y, T, N, K);
}

// One work item of records of `type`: channel vectors [v0, v1) x rows [t0, t1) of p (q4_1::run_item).
inline void run_item(int64_t type, const q4_1::Problem& p, int64_t v0, int64_t v1, int64_t t0, int64_t t1) {
  if (type == kQ4_K) q4_1::run_item<q4_k::Format>(p, v0, v1, t0, t1);
  else if (type == kQ6_K) q4_1::run_item<q6_k::Format>(p, v0, v1, t0, t1);
  else q4_1::run_item<q8_0::Format>(p, v0, v1, t0, t1);
}

}  // namespace gguf_records
}  // namespace kiln
