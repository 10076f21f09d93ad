// kiln.MoE's pieces shared by its step (moe.cc) and its Q4_1 experts (moe_q4_1.cc): the tokens grouped by expert,
// work items over an expert's weight rows, SwiGLU, and the Q4_1 experts in MatMulQ4_1's records.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "onnxruntime_lite_custom_op.h"
#include "q4_1_records.h"

namespace kiln {
namespace moe {

struct Groups {
  std::vector<int64_t> start;   // [E + 1]: expert e's rows of the grouped buffers are [start[e], start[e + 1])
  std::vector<int64_t> token;   // [T * top_k]: the token of each grouped row
  std::vector<int64_t> row_of;  // [T * top_k]: the grouped row of (token t, slot j) at t * top_k + j
  int64_t experts() const { return static_cast<int64_t>(start.size()) - 1; }
};

// A work item: expert e's units [u0, u1) (weight rows for float experts, channel groups of 16 for Q4_1 ones).
struct Item {
  int64_t expert, u0, u1;
};

// The items over `units` of every expert that has rows, `per_item` units each.
inline std::vector<Item> items_over(const Groups& g, int64_t units, int64_t per_item) {
  std::vector<Item> items;
  for (int64_t e = 0; e < g.experts(); ++e)
    if (g.start[e + 1] > g.start[e])
      for (int64_t u = 0; u < units; u += per_item) items.push_back({e, u, std::min(units, u + per_item)});
  return items;
}

inline float silu_times(float gate, float up) {
  // sigmoid from exp(-|gate|) <= 1: no overflow for any finite gate
  const float e = std::exp(-std::fabs(gate));
  const float sigmoid = gate >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
  return gate * sigmoid * up;
}

// One projection's Q4_1 expert stack [E, rows, K] as MatMulQ4_1's records, expert after expert: expert e's
// records [rows / 16, K / 32, 320] from records.data() + e * expert_bytes(). rows a multiple of 16, K of 32.
struct Q4_1Experts {
  q4_1::AlignedVector<uint8_t> records;
  int64_t rows = 0, nb = 0;

  // From the op's nibbles [E, rows, K / 2] (a block's 16 bytes: element j low, j + 16 high) and dm [E, rows, K / 32, 2].
  static Q4_1Experts pack(const uint8_t* nibbles, const uint16_t* dm, int64_t E, int64_t rows, int64_t K);
  bool empty() const { return records.empty(); }
  int64_t group_bytes() const { return nb * q4_1::kRecordBytes; }
  int64_t expert_bytes() const { return rows / q4_1::kGroup * group_bytes(); }
  const uint8_t* expert(int64_t e) const { return records.data() + e * expert_bytes(); }
};

// expert_out [rows.size(), D] = each grouped row's expert (g) applied to it: rows[i] is grouped row i's input
// (length D), gate_up [E, 2F, D] and down [E, D, F] Q4_1, activations int8 as kiln.MatMulQ4_1's.
void run_q4_1_experts(OrtKernelContext* ctx, const Groups& g, const std::vector<const float*>& rows,
                      const Q4_1Experts& gate_up, const Q4_1Experts& down, float* expert_out);

}  // namespace moe
}  // namespace kiln
