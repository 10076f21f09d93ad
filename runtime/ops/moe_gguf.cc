// kiln.MoE's GGUF experts: kiln.MatMulGGUF's int8 arithmetic (matmul_gguf_int8.h) over each expert's grouped rows,
// on the file's blocks as they are (no repacking), or its records' (gguf_records.h) on records an engine stores.
//
// The tokens are quantized once each for gate and up (once in all when the two types share an activation layout),
// then copied, as int8, into the grouped order; silu(gate) * up is quantized once per grouped row for down. Work items
// are (expert, range of output channels) over all of the expert's rows with MatMulGGUF's own item: each selected
// expert's blocks are read once per step whatever the number of its rows (in tiles of rows that find an item's
// blocks in cache), and experts no token chose are never touched. A row's arithmetic is the same in every tile, so a
// token's output does not depend on its batch.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gguf_records.h"
#include "matmul_gguf.h"
#include "matmul_gguf_int8.h"
#include "moe_experts.h"
#include "parallel_for.h"
#include "shape_text.h"

namespace kiln {
namespace moe {

using gguf_int8::Int8Rows;
using gguf_int8::Layout;

namespace {

// Weight bytes a work item reads, about (as the Q4_1 experts' items): well above an item's dispatch cost, and a
// decode step (8 experts x 1024 channels) still has hundreds of items for the pool to balance.
constexpr int64_t kItemBytes = 64 << 10;

[[noreturn]] void fail(const std::string& what) { throw Ort::Exception("kiln.MoE: " + what, ORT_INVALID_ARGUMENT); }

GgufBlockType checked_type(int64_t type, bool int8, const char* attribute, int64_t K, const char* k_name) {
  GgufBlockType b;
  if (int8 && !gguf_int8::block_type(type, b))
    fail(std::string(attribute) + " " + std::to_string(type) + " has no kernel for GGUF experts with int8 activations "
         "(Q4_0 = 2, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14; Q5_0 and Q5_1 take int8_activations = 0)");
  if (!int8 && !gguf_float::block_type(type, b))
    fail(std::string(attribute) + " " + std::to_string(type) + " has no kernel for GGUF experts (Q4_0 = 2, Q5_0 = 6, "
         "Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14)");
  if (K % b.weights != 0)
    fail(std::string(attribute) + " " + b.name + " needs " + k_name + " a multiple of " + std::to_string(b.weights) +
         ", got " + std::to_string(K));
  return b;
}

// src's rows index[i] into dst's row i (the same layout).
void gather_rows(const Int8Rows& src, const std::vector<int64_t>& index, Int8Rows& dst) {
  const int64_t n = static_cast<int64_t>(index.size()), K = src.K;
  const int64_t steps = K / src.block, sums = src.sums.empty() ? 0 : K / gguf_int8::kSumGroup;
  const int64_t subs = src.sub_sum.empty() ? 0 : K / 32;
  dst.K = K, dst.block = src.block;
  dst.q.resize(n * K), dst.step.resize(n * steps), dst.sums.resize(n * sums);
  dst.sub_sum.resize(n * subs), dst.sub_error.resize(n * subs);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = index[i];
    std::memcpy(dst.q.data() + i * K, src.q.data() + t * K, K);
    std::copy_n(src.step.data() + t * steps, steps, dst.step.data() + i * steps);
    std::copy_n(src.sums.data() + t * sums, sums, dst.sums.data() + i * sums);
    std::copy_n(src.sub_sum.data() + t * subs, subs, dst.sub_sum.data() + i * subs);
    std::copy_n(src.sub_error.data() + t * subs, subs, dst.sub_error.data() + i * subs);
  }
}

// The grouped rows of x's tokens quantized for `layout`: each token once, then copied per grouped row.
void grouped_activations(OrtKernelContext* ctx, const Layout& layout, const float* x, int64_t T, int64_t D,
                         const Groups& g, Int8Rows& out) {
  std::vector<const float*> tokens(T);
  for (int64_t t = 0; t < T; ++t) tokens[t] = x + t * D;
  Int8Rows once;
  gguf_int8::quantize_rows(ctx, layout, tokens.data(), T, D, once);
  gather_rows(once, g.token, out);
}

int64_t channels_per_item(int64_t row_bytes) { return std::max<int64_t>(1, kItemBytes / row_bytes); }

enum class Projection { kGate, kUp, kDown };

// A projection's matmul over expert e's rows of its stack, writing y [rows, N] (ld N).
GgufMatmul expert_matmul(const GgufStack& s, int64_t e, int64_t K, int64_t n_rows, float* y) {
  return GgufMatmul{s.w + e * s.expert_bytes, nullptr, nullptr, y, n_rows, s.rows, K, s.stride};
}

}  // namespace

GgufExperts checked_gguf_experts(const int64_t types[3], bool int8_activations, const uint8_t* gate_up,
                                 const std::vector<int64_t>& gate_up_shape, const uint8_t* down,
                                 const std::vector<int64_t>& down_shape, int64_t D) {
  if (gate_up_shape.size() != 3 || gate_up_shape[1] % 2 != 0)
    fail("GGUF gate_up must be [E, 2F, row bytes], got " + shape_text(gate_up_shape));
  const int64_t E = gate_up_shape[0], F = gate_up_shape[1] / 2;
  const bool i8 = int8_activations;
  const auto gate = checked_type(types[0], i8, "gate_type", D, "D"), up = checked_type(types[1], i8, "up_type", D, "D");
  const auto dn = checked_type(types[2], i8, "down_type", F, "F");
  const int64_t gate_bytes = D / gate.weights * gate.bytes, up_bytes = D / up.weights * up.bytes;
  const int64_t gate_up_bytes = std::max(gate_bytes, up_bytes), down_bytes = F / dn.weights * dn.bytes;
  if (gate_up_shape[2] != gate_up_bytes)
    fail("GGUF gate_up must be [E, 2F, " + std::to_string(gate_up_bytes) + "] (rows of D = " + std::to_string(D) +
         " as " + gate.name + " gate and " + up.name + " up blocks), got " + shape_text(gate_up_shape));
  if (down_shape != std::vector<int64_t>{E, D, down_bytes})
    fail("GGUF down must be " + shape_text({E, D, down_bytes}) + " (rows of F = " + std::to_string(F) + " as " +
         dn.name + " blocks), got " + shape_text(down_shape));
  GgufExperts x;
  x.gate = {gate_up, types[0], F, gate_up_bytes, 2 * F * gate_up_bytes};
  x.up = {gate_up + F * gate_up_bytes, types[1], F, gate_up_bytes, 2 * F * gate_up_bytes};
  x.down = {down, types[2], D, down_bytes, D * down_bytes};
  x.int8 = int8_activations;
  return x;
}

GgufExperts checked_gguf_expert_records(const int64_t types[3], const uint8_t* gate_up,
                                        const std::vector<int64_t>& gate_up_shape, const uint8_t* down,
                                        const std::vector<int64_t>& down_shape, int64_t D) {
  const int64_t gate_bytes = gguf_records::record_bytes(types[0]), down_bytes = gguf_records::record_bytes(types[2]);
  if (gate_bytes == 0 || types[1] != types[0] || down_bytes == 0)
    fail("layout \"records\" holds GGUF experts of Q4_K, Q5_K, Q6_K or Q8_0 (12, 13, 14, 8), gate and up of one "
         "type; got gate_type " + std::to_string(types[0]) + ", up_type " + std::to_string(types[1]) +
         ", down_type " + std::to_string(types[2]));
  constexpr int64_t kGroup = q4_1::kGroup, kSuper = gguf_records::kSuperBlock;
  if (gate_up_shape.size() != 4 || gate_up_shape[1] % 2 != 0 || gate_up_shape[3] != gate_bytes ||
      D % kSuper != 0 || gate_up_shape[2] != D / kSuper)
    fail("GGUF gate_up records must be [E, 2F / 16, D / 256 = " + std::to_string(D / kSuper) + ", " +
         std::to_string(gate_bytes) + "], got " + shape_text(gate_up_shape));
  const int64_t E = gate_up_shape[0], F = gate_up_shape[1] / 2 * kGroup;
  const std::vector<int64_t> want_down{E, D / kGroup, F / kSuper, down_bytes};
  if (F % kSuper != 0 || D % kGroup != 0 || down_shape != want_down)
    fail("GGUF down records must be " + shape_text(want_down) + " for F = " + std::to_string(F) + " (a multiple of " +
         "256) and D = " + std::to_string(D) + ", got " + shape_text(down_shape));
  const int64_t gate_group = D / kSuper * gate_bytes, down_group = F / kSuper * down_bytes;
  GgufExperts x;
  x.gate = {gate_up, types[0], F, gate_group, 2 * F / kGroup * gate_group};
  x.up = {gate_up + F / kGroup * gate_group, types[1], F, gate_group, 2 * F / kGroup * gate_group};
  x.down = {down, types[2], D, down_group, D / kGroup * down_group};
  x.int8 = x.records = true;
  return x;
}

namespace {

// The records' activations (kiln/gguf_records.py): the tokens quantized per block of 32 once for gate and up, then
// copied into the grouped order; silu(gate) * up once per grouped row for down.
struct RecordsPath {
  q4_1::Int8Rows grouped, down_q;

  RecordsPath(OrtKernelContext* ctx, const Groups& g, const float* x, int64_t T, const GgufExperts& experts) {
    const int64_t D = experts.down.rows;
    q4_1::Int8Rows once;
    gguf_records::quantize_rows(ctx, experts.gate.type, T, D, [&](size_t t) { return x + t * D; }, once);
    q4_1::gather_rows(once, g.token, grouped);
  }
  // channels a work item: whole groups of 16, about kItemBytes of the stack's records
  static int64_t item_channels(const GgufStack& s) {
    const int64_t per = kItemBytes / std::max<int64_t>(1, s.stride) * q4_1::kGroup;
    return std::max<int64_t>(q4_1::kGroup, per);
  }
  void prepare_down(OrtKernelContext* ctx, const GgufStack& down, const std::vector<float>& act, int64_t n_rows,
                    int64_t F) {
    gguf_records::quantize_rows(ctx, down.type, n_rows, F, [&](size_t t) { return act.data() + t * F; }, down_q);
  }
  void project(Projection which, const GgufStack& s, const GgufMatmul& m, const Item& it, int64_t first,
               int64_t last) const {
    const q4_1::Int8Rows& a = which == Projection::kDown ? down_q : grouped;
    const q4_1::Problem p{s.w + it.expert * s.expert_bytes, nullptr, &a, m.y, s.rows, a.nb, s.stride};
    gguf_records::run_item(s.type, p, it.u0 / q4_1::kLanes, it.u1 / q4_1::kLanes, first, last);
  }
};

// The int8 path's activations (kiln/gguf_int8.py): the tokens quantized once for gate and up (once in all when
// their layouts share a block), silu(gate) * up once per grouped row for down.
struct Int8Path {
  Int8Rows gate_q, up_own, down_q;
  bool shared = false;  // up reads gate_q

  Int8Path(OrtKernelContext* ctx, const Groups& g, const float* x, int64_t T, const GgufExperts& experts) {
    const int64_t D = experts.down.rows;
    Layout gate_layout = gguf_int8::layout_of(experts.gate.type);
    const Layout up_layout = gguf_int8::layout_of(experts.up.type);
    shared = gate_layout.block == up_layout.block;
    if (shared) gate_layout.sums |= up_layout.sums, gate_layout.sub_sums |= up_layout.sub_sums;
    grouped_activations(ctx, gate_layout, x, T, D, g, gate_q);
    if (!shared) grouped_activations(ctx, up_layout, x, T, D, g, up_own);
  }
  void prepare_down(OrtKernelContext* ctx, const GgufStack& down, const std::vector<float>& act, int64_t n_rows,
                    int64_t F) {
    std::vector<const float*> rows(n_rows);
    for (int64_t i = 0; i < n_rows; ++i) rows[i] = act.data() + i * F;
    gguf_int8::quantize_rows(ctx, gguf_int8::layout_of(down.type), rows.data(), n_rows, F, down_q);
  }
  static int64_t item_channels(const GgufStack& s) { return channels_per_item(s.stride); }
  void project(Projection which, const GgufStack& s, const GgufMatmul& m, const Item& it, int64_t first,
               int64_t last) const {
    const Int8Rows& a = which == Projection::kDown ? down_q : which == Projection::kUp && !shared ? up_own : gate_q;
    gguf_int8::run_item(s.type, m, a, it.u0, it.u1, first, last);
  }
};

// The float32 path's activations (kiln/matmul_gguf.py): the tokens' rows copied into the grouped order, and the
// row sums of 32 the types with minimums need.
struct FloatPath {
  std::vector<float> rows, gate_sums, up_sums, down_sums;
  const float* act = nullptr;

  FloatPath(const Groups& g, const float* x, const GgufExperts& experts) {
    const int64_t n_rows = static_cast<int64_t>(g.token.size()), D = experts.down.rows;
    rows.resize(n_rows * D);
    for (int64_t i = 0; i < n_rows; ++i) std::copy_n(x + g.token[i] * D, D, rows.data() + i * D);
    gate_sums = gguf_float::row_sums_for(experts.gate.type, rows.data(), n_rows, D);
    up_sums = gguf_float::row_sums_for(experts.up.type, rows.data(), n_rows, D);
  }
  void prepare_down(OrtKernelContext*, const GgufStack& down, const std::vector<float>& activations, int64_t n_rows,
                    int64_t F) {
    act = activations.data();
    down_sums = gguf_float::row_sums_for(down.type, act, n_rows, F);
  }
  static int64_t item_channels(const GgufStack& s) { return channels_per_item(s.stride); }
  void project(Projection which, const GgufStack& s, GgufMatmul m, const Item& it, int64_t first,
               int64_t last) const {
    m.x = which == Projection::kDown ? act : rows.data();
    const std::vector<float>& sums = which == Projection::kDown ? down_sums
                                     : which == Projection::kUp ? up_sums : gate_sums;
    gguf_float::run_item(s.type, m, sums.data(), it.u0, it.u1, first, last);
  }
};

// The two phases on either path: (expert, range of F's channels, gate or up) items over all of the expert's rows,
// silu(gate) * up, then (expert, range of D's channels) items of down.
template <class Path>
void run_phases(OrtKernelContext* ctx, const Groups& g, const GgufExperts& experts, Path& path, float* expert_out) {
  const GgufStack &gate = experts.gate, &up = experts.up, &down = experts.down;
  const int64_t n_rows = static_cast<int64_t>(g.token.size()), F = gate.rows, D = down.rows;
  std::vector<float> gate_out(n_rows * F), up_out(n_rows * F), act(n_rows * F);
  const std::vector<ProjectionItem> gate_up_items = gate_then_up_items(g, F, Path::item_channels(gate));
  auto gate_up_item = [&](size_t i) {
    const Item& it = gate_up_items[i].item;
    const bool is_up = gate_up_items[i].up;
    const GgufStack& s = is_up ? up : gate;
    path.project(is_up ? Projection::kUp : Projection::kGate, s,
                 expert_matmul(s, it.expert, D, n_rows, is_up ? up_out.data() : gate_out.data()), it,
                 g.start[it.expert], g.start[it.expert + 1]);
  };
  parallel_for(ctx, gate_up_items.size(), gate_up_item);
  swiglu_rows(ctx, gate_out.data(), up_out.data(), F, n_rows, F, act.data());

  path.prepare_down(ctx, down, act, n_rows, F);
  const std::vector<Item> items = items_over(g, D, Path::item_channels(down));
  auto down_item = [&](size_t i) {
    const Item& it = items[i];
    path.project(Projection::kDown, down, expert_matmul(down, it.expert, F, n_rows, expert_out), it,
                 g.start[it.expert], g.start[it.expert + 1]);
  };
  parallel_for(ctx, items.size(), down_item);
}

}  // namespace

void run_gguf_experts(OrtKernelContext* ctx, const Groups& g, const float* x, int64_t T, const GgufExperts& experts,
                      float* expert_out) {
  if (experts.records) {
    RecordsPath path(ctx, g, x, T, experts);
    run_phases(ctx, g, experts, path, expert_out);
  } else if (experts.int8) {
    Int8Path path(ctx, g, x, T, experts);
    run_phases(ctx, g, experts, path, expert_out);
  } else {
    FloatPath path(g, x, experts);
    run_phases(ctx, g, experts, path, expert_out);
  }
}

}  // namespace moe
}  // namespace kiln
