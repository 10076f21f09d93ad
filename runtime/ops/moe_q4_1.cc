// kiln.MoE's Q4_1 experts: kiln.MatMulQ4_1's arithmetic (q4_1_records.h) over each expert's grouped rows.
//
// Each projection's expert stack is MatMulQ4_1's records, expert after expert: an engine's as it stores them (layout
// "records", read where ONNX Runtime maps them), or repacked from blocks (once, at session load, for constant
// weights; older engines). A phase quantizes its grouped rows to int8 per block of 32 (step, exact float sum and the
// centring term, as MatMulQ4_1 does), then runs work items of (expert, chunk of 16-channel groups) over all of the
// expert's rows with MatMulQ4_1's tile: each selected expert's records are read once per step whatever the number
// of its rows, in passes of rows that reuse a group's records from L1. A row's outputs are the same arithmetic in
// every pass size, so a token's output does not depend on its batch.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "moe_experts.h"
#include "parallel_for.h"

namespace kiln {
namespace moe {

using namespace q4_1;  // NOLINT: the records, the activations and the tile (q4_1_records.h)

// Weight bytes a work item reads, about: 64 KiB is ~3 us of DRAM bandwidth, well above an item's dispatch cost, and
// a decode step (8 experts x 64 gate/up groups) still has hundreds of items for the pool to balance.
constexpr int64_t kItemBytes = 64 << 10;
constexpr int64_t kParallelQuantize = 1 << 15;  // activation elements from which quantizing is parallel
constexpr int64_t kVectorsPerGroup = kGroup / kLanes;

Q4_1Experts Q4_1Experts::pack(const uint8_t* nibbles, const uint16_t* dm, int64_t E, int64_t rows, int64_t K) {
  Q4_1Experts s;
  s.rows = rows;
  s.nb = K / kBlock;
  s.packed.assign(E * s.expert_bytes(), 0);
  uint8_t q[kBlock];
  for (int64_t r = 0; r < E * rows; ++r) {  // expert e's row n is r = e * rows + n
    const int64_t e = r / rows, n = r % rows;
    uint8_t* group = s.packed.data() + e * s.expert_bytes() + (n / kGroup) * s.group_bytes();
    for (int64_t b = 0; b < s.nb; ++b) {
      const uint8_t* src = nibbles + r * (K / 2) + b * (kBlock / 2);
      for (int64_t i = 0; i < kBlock / 2; ++i) {
        q[i] = src[i] & 15;
        q[kBlock / 2 + i] = src[i] >> 4;
      }
      const uint16_t* steps = dm + (r * s.nb + b) * 2;
      write_block(group, n % kGroup, b, q, steps[0], steps[1]);
    }
  }
  return s;
}

namespace {

// Groups a work item takes so that it reads about kItemBytes of one projection.
int64_t groups_per_item(const Q4_1Experts& w) {
  return std::max<int64_t>(1, kItemBytes / w.group_bytes());
}

}  // namespace

void run_q4_1_experts(OrtKernelContext* ctx, const Groups& g, const std::vector<const float*>& rows,
                      const Q4_1Experts& gate_up, const Q4_1Experts& down, float centre, float* expert_out) {
  const int64_t n_rows = static_cast<int64_t>(rows.size()), F = gate_up.rows / 2, D = down.rows;
  Int8Rows xq;
  quantize_rows(ctx, n_rows, D, Q4_1Format::kSums16, centre, [&](size_t i) { return rows[i]; }, xq);

  // gate/up: an item is (expert, chunk of F's groups, gate or up); it computes those channels for all of the
  // expert's rows into `hidden` [rows, 2F]; then act [rows, F] = silu(gate) * up.
  std::vector<float> hidden(n_rows * 2 * F), act(n_rows * F);
  const std::vector<ProjectionItem> gate_up_items = gate_then_up_items(g, F / kGroup, groups_per_item(gate_up));
  auto gate_up_item = [&](size_t i) {
    const Item& it = gate_up_items[i].item;
    const Problem p{gate_up.expert(it.expert), nullptr, &xq, hidden.data(), 2 * F, gate_up.nb, gate_up.group_bytes()};
    const int64_t v0 = it.u0 * kVectorsPerGroup, v1 = it.u1 * kVectorsPerGroup;
    const int64_t offset = gate_up_items[i].up ? F / kLanes : 0;  // up's channels follow gate's
    run_item(p, offset + v0, offset + v1, g.start[it.expert], g.start[it.expert + 1]);
  };
  parallel_for(ctx, gate_up_items.size(), gate_up_item);
  swiglu_rows(ctx, hidden.data(), hidden.data() + F, 2 * F, n_rows, F, act.data());

  Int8Rows aq;
  quantize_rows(ctx, n_rows, F, Q4_1Format::kSums16, centre,
                [&](size_t i) { return act.data() + i * F; }, aq);
  const std::vector<Item> items = items_over(g, D / kGroup, groups_per_item(down));
  auto down_item = [&](size_t i) {
    const Item& it = items[i];
    const Problem p{down.expert(it.expert), nullptr, &aq, expert_out, D, down.nb, down.group_bytes()};
    run_item(p, it.u0 * kVectorsPerGroup, it.u1 * kVectorsPerGroup, g.start[it.expert], g.start[it.expert + 1]);
  };
  parallel_for(ctx, items.size(), down_item);
}

}  // namespace moe
}  // namespace kiln
