// kiln.MoE's pieces shared by its step (moe.cc), its Q4_1 experts (moe_q4_1.cc) and its GGUF experts (moe_gguf.cc):
// the tokens grouped by expert, work items over an expert's weight rows, SwiGLU, the Q4_1 experts in MatMulQ4_1's
// records, and the GGUF experts as the file's blocks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "onnxruntime_lite_custom_op.h"
#include "q4_1_records.h"
#include "swiglu.h"

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

// The gate/up phase's items: each expert's gate items, then its up items (`up`). An expert's up rows follow its gate
// rows in its stack, so a thread taking a run of these items reads one run of memory; an item of both a gate and an
// up range would alternate between two runs 1-2 MB apart, which measured 0.7x the read rate of one run at one row.
struct ProjectionItem {
  Item item;
  bool up;
};

inline std::vector<ProjectionItem> gate_then_up_items(const Groups& g, int64_t units, int64_t per_item) {
  std::vector<ProjectionItem> items;
  for (int64_t e = 0; e < g.experts(); ++e)
    if (g.start[e + 1] > g.start[e])
      for (const bool up : {false, true})
        for (int64_t u = 0; u < units; u += per_item) items.push_back({{e, u, std::min(units, u + per_item)}, up});
  return items;
}

// One projection's Q4_1 expert stack [E, rows, K] as MatMulQ4_1's records, expert after expert: expert e's
// records [rows / 16, K / 32, 320] from data() + e * expert_bytes(). rows a multiple of 16, K of 32. The records are
// the op's own input (layout "records": read where ONNX Runtime has the tensor, mapped from the engine file) or
// packed from its blocks into memory of the stack's.
struct Q4_1Experts {
  q4_1::AlignedVector<uint8_t> packed;  // records packed from blocks; empty when read in place
  const uint8_t* in_place = nullptr;    // the op's records input, when the stack reads it where it lies
  int64_t rows = 0, nb = 0;

  // From the op's nibbles [E, rows, K / 2] (a block's 16 bytes: element j low, j + 16 high) and dm [E, rows, K / 32, 2].
  static Q4_1Experts pack(const uint8_t* nibbles, const uint16_t* dm, int64_t E, int64_t rows, int64_t K);
  // The op's records [E, rows / 16, K / 32, 320], read where they lie (no copy; the tile's loads are unaligned, so
  // any address works, and an engine's sit on page boundaries).
  static Q4_1Experts view(const uint8_t* records, int64_t rows, int64_t K) {
    Q4_1Experts s;
    s.in_place = records;
    s.rows = rows;
    s.nb = K / q4_1::kBlock;
    return s;
  }
  bool empty() const { return in_place == nullptr && packed.empty(); }
  const uint8_t* data() const { return in_place != nullptr ? in_place : packed.data(); }
  int64_t group_bytes() const { return nb * q4_1::kRecordBytes; }
  int64_t expert_bytes() const { return rows / q4_1::kGroup * group_bytes(); }
  const uint8_t* expert(int64_t e) const { return data() + e * expert_bytes(); }
};

// expert_out [rows.size(), D] = each grouped row's expert (g) applied to it: rows[i] is grouped row i's input
// (length D), gate_up [E, 2F, D] and down [E, D, F] Q4_1, activations int8 as kiln.MatMulQ4_1's with its `centre`.
void run_q4_1_experts(OrtKernelContext* ctx, const Groups& g, const std::vector<const float*>& rows,
                      const Q4_1Experts& gate_up, const Q4_1Experts& down, float centre, float* expert_out);

// One projection's GGUF expert stack: expert e's weight row n is the `type` blocks at w + e * expert_bytes + n * stride.
struct GgufStack {
  const uint8_t* w = nullptr;
  int64_t type = 0, rows = 0, stride = 0, expert_bytes = 0;
};

// GGUF experts: gate and up [E, F, D] (the op's gate_up rows [0, F) and [F, 2F)), down [E, D, F], and the
// activations' path (int8: kiln.MatMulGGUF's int8_activations = 1; else its float32 one). As records (layout
// "records": kiln.MatMulGGUF's, each expert's after the other's) a stack's `stride` is a group of 16 channels' bytes
// and gate and up are the first and last F / 16 groups of each expert's gate_up records.
struct GgufExperts {
  GgufStack gate, up, down;
  bool int8 = true, records = false;
};

// The op's gate_up [E, 2F, gate_up_bytes] and down [E, D, down_bytes] with the node's ggml types, checked (each type
// one the activations' path has a kernel for, D and F whole blocks of it, each stack's rows as wide as its types
// need); a problem throws an Ort::Exception that names it.
GgufExperts checked_gguf_experts(const int64_t types[3], bool int8_activations, const uint8_t* gate_up,
                                 const std::vector<int64_t>& gate_up_shape, const uint8_t* down,
                                 const std::vector<int64_t>& down_shape, int64_t D);

// The op's records gate_up [E, 2F / 16, D / 256, gate record bytes] and down [E, D / 16, F / 256, down record bytes]
// (gate and up one type; each type one with records), checked likewise.
GgufExperts checked_gguf_expert_records(const int64_t types[3], const uint8_t* gate_up,
                                        const std::vector<int64_t>& gate_up_shape, const uint8_t* down,
                                        const std::vector<int64_t>& down_shape, int64_t D);

// expert_out [T * top_k, D] = each grouped row's expert (g) applied to its token of x [T, D], each projection with
// kiln.MatMulGGUF's arithmetic on the experts' activation path (kiln/gguf_int8.py or kiln/matmul_gguf.py).
void run_gguf_experts(OrtKernelContext* ctx, const Groups& g, const float* x, int64_t T, const GgufExperts& experts,
                      float* expert_out);

}  // namespace moe
}  // namespace kiln
